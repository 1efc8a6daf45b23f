"""Conversions between core types and their protobuf messages. Torch-free (the router uses them); the
tensor-carrying parts (sparse q, KV chunks) are in tensor_convert.py."""

from __future__ import annotations

import math
import re

from specserve.catalog import MethodSupport
from specserve.core.constraint import Constraint, ConstraintKind
from specserve.core.cost import VerifyPoints, verify_points_from_json
from specserve.core.protocols import CandidateKind, DraftTree, SuffixTrust, VerifyOutcome
from specserve.core.request import GenerationRequest, RequestLimits, check_sampling
from specserve.core.sampling_params import SamplingParams
from specserve.core.tree import TokenTree
from specserve.errors import InvalidArgument, quoted
from specserve.results import FinishReason, GenerationStats, TokenLogprob
from specserve.v1 import common_pb2, router_pb2, target_pb2

SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # the whole id (fullmatch: "$" would let "id\n" in)
PROBS_SUM_TOLERANCE = 1e-3  # float32 probabilities of a whole vocabulary sum to 1 within ~1e-5

_KIND_TO_PB = {
    CandidateKind.FIXED: common_pb2.CANDIDATE_KIND_FIXED,
    CandidateKind.SAMPLED: common_pb2.CANDIDATE_KIND_SAMPLED,
    CandidateKind.SAMPLED_WITHOUT_REPLACEMENT: common_pb2.CANDIDATE_KIND_SAMPLED_WITHOUT_REPLACEMENT,
}
_KIND_FROM_PB = {v: k for k, v in _KIND_TO_PB.items()}

_FINISH_TO_PB = {
    FinishReason.EOS: common_pb2.FINISH_REASON_EOS,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
}


def check_session_id(session_id: str) -> str:
    if not SESSION_ID.fullmatch(session_id):
        raise InvalidArgument(f"session_id must match {SESSION_ID.pattern}, got {quoted(session_id)}")
    return session_id


def sampling_to_pb(sampling: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k
    )


def sampling_from_pb(message: common_pb2.SamplingParams) -> SamplingParams:
    """A session's sampling as a router sends it to the target and draft services, checked as a
    request's is. top_p 0 means "off", like 1."""
    sampling = SamplingParams(
        temperature=message.temperature,
        top_p=message.top_p if message.top_p != 0 else 1.0,
        top_k=message.top_k,
    )
    check_sampling(sampling)
    return sampling


_CONSTRAINT_TO_PB = {
    ConstraintKind.JSON_SCHEMA: common_pb2.CONSTRAINT_KIND_JSON_SCHEMA,
    ConstraintKind.JSON_OBJECT: common_pb2.CONSTRAINT_KIND_JSON_OBJECT,
    ConstraintKind.REGEX: common_pb2.CONSTRAINT_KIND_REGEX,
    ConstraintKind.GRAMMAR: common_pb2.CONSTRAINT_KIND_GRAMMAR,
}
_CONSTRAINT_FROM_PB = {v: k for k, v in _CONSTRAINT_TO_PB.items()}


def constraint_to_pb(constraint: Constraint | None) -> common_pb2.Constraint | None:
    if constraint is None:
        return None
    return common_pb2.Constraint(kind=_CONSTRAINT_TO_PB[constraint.kind], source=constraint.source)


def constraint_from_pb(message: common_pb2.Constraint) -> Constraint | None:
    """None for an unset or UNSPECIFIED constraint; InvalidArgument (InvalidConstraint) for a bad one."""
    if message.kind == common_pb2.CONSTRAINT_KIND_UNSPECIFIED:
        if message.source:
            raise InvalidArgument("constraint.kind is required when constraint.source is set")
        return None
    kind = _CONSTRAINT_FROM_PB.get(message.kind)
    if kind is None:
        raise InvalidArgument(f"unknown constraint.kind {message.kind}")
    return Constraint(kind, message.source)


def request_from_pb(
    message: router_pb2.GenerateRequest,
    prompt_ids: list[int],
    limits: RequestLimits,
    default_method: str,
    default_max_new_tokens: int,
) -> GenerationRequest:
    """A public Generate request (its prompt already tokenized), validated by GenerationRequest.build.
    The router's defaults apply where it names no method and no token limit (max_new_tokens 0)."""
    sampling = message.sampling
    return GenerationRequest.build(
        method=message.method or default_method,
        temperature=sampling.temperature,
        top_p=sampling.top_p if sampling.top_p != 0 else 1.0,
        top_k=sampling.top_k,
        max_new_tokens=message.max_new_tokens or default_max_new_tokens,
        stop=tuple(message.stop),
        ignore_eos=message.ignore_eos,
        seed=sampling.seed if sampling.HasField("seed") else None,
        logprobs=message.logprobs,
        top_logprobs=message.top_logprobs,
        constraint=constraint_from_pb(message.constraint) if message.HasField("constraint") else None,
        limits=limits,
        prompt_ids=prompt_ids,
    )


def limits_from_model_info(info: target_pb2.ModelInfo, methods: MethodSupport) -> RequestLimits:
    """What a router accepts: its targets' bounds, and the methods it can run (`methods`)."""
    return RequestLimits(
        max_new_tokens_limit=info.max_new_tokens_limit,
        max_prompt_tokens=info.max_prompt_tokens,
        max_context=info.max_context,
        max_tree_nodes=info.max_tree_nodes,
        vocab_size=info.vocab_size,
        methods=methods,
        supports_logprobs=info.supports_logprobs,
    )


def tree_to_pb(draft: DraftTree) -> common_pb2.DraftTree:
    """The tree's structure. A tree with q (tensors) goes through tensor_convert.draft_to_pb."""
    if draft.draft_probs:
        raise TypeError("a tree with draft_probs is converted by tensor_convert.draft_to_pb")
    return common_pb2.DraftTree(
        token_ids=draft.tree.token_ids, parent_ids=draft.tree.parent_ids, kind=_KIND_TO_PB[draft.kind]
    )


def tree_from_pb(message: common_pb2.DraftTree, max_nodes: int) -> DraftTree:
    """Validates the whole message (InvalidArgument on a malformed or oversized tree, or on q that is no
    distribution) and returns its structure. q stays in the message: the target makes tensors of it
    (tensor_convert.with_dense_probs), the router forwards the message as it came (remote.py)."""
    if len(message.token_ids) > max_nodes:
        raise InvalidArgument(f"the tree has {len(message.token_ids)} nodes; at most {max_nodes} allowed")
    if message.kind not in _KIND_FROM_PB:
        raise InvalidArgument("tree.kind must be set")
    tree = TokenTree(tuple(message.token_ids), tuple(message.parent_ids))
    kind = _KIND_FROM_PB[message.kind]
    probs = {q.node: q for q in message.draft_probs}
    if len(probs) != len(message.draft_probs):
        raise InvalidArgument("draft_probs has two entries for one node")
    for q in message.draft_probs:
        check_sparse_probs(q)
    if kind is not CandidateKind.FIXED:
        internal = {p for p in tree.parent_ids if p >= 0}
        if set(probs) != internal:
            raise InvalidArgument("sampled candidates need draft_probs for exactly the internal nodes")
    elif probs:
        raise InvalidArgument("fixed candidates carry no draft_probs")
    return DraftTree(tree, kind)


def check_sparse_probs(q: common_pb2.SparseProbs) -> None:
    """A distribution over distinct token ids: one probability each, finite, in [0, 1], summing to at most
    1 (float32 rounding allowed). The acceptance rule divides by these and compares against them, so
    NaN, negative or huge values would be committed as if they were real probabilities."""
    if len(q.token_ids) != len(q.probs):
        raise InvalidArgument(
            f"draft_probs of node {q.node}: {len(q.token_ids)} token ids but {len(q.probs)} probs"
        )
    if len(set(q.token_ids)) != len(q.token_ids):
        raise InvalidArgument(f"draft_probs of node {q.node}: repeated token ids")
    if not all(0.0 <= p <= 1.0 for p in q.probs):  # False for NaN too
        raise InvalidArgument(f"draft_probs of node {q.node}: probabilities must be in [0, 1]")
    if math.fsum(q.probs) > 1.0 + PROBS_SUM_TOLERANCE:
        raise InvalidArgument(f"draft_probs of node {q.node}: probabilities sum to more than 1")


def outcome_from_pb(message: target_pb2.VerifyResponse) -> VerifyOutcome:
    return VerifyOutcome(list(message.accepted_nodes), message.next_token)


def logprobs_to_pb(logprobs: list[TokenLogprob]) -> list[common_pb2.TokenLogprob]:
    """The target's Prefill and Verify responses carry these (core/logprobs.py computes them)."""
    return [
        common_pb2.TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top_token_ids=[token for token, _ in lp.top],
            top_logprobs=[value for _, value in lp.top],
        )
        for lp in logprobs
    ]


def finish_to_pb(reason: FinishReason | None) -> common_pb2.FinishReason:
    return common_pb2.FINISH_REASON_UNSPECIFIED if reason is None else _FINISH_TO_PB[reason]


def stats_to_pb(stats: GenerationStats, **extra: float | int) -> router_pb2.GenerationStats:
    message = router_pb2.GenerationStats(
        num_generated_tokens=stats.num_generated_tokens,
        num_target_forwards=stats.num_target_forwards,
        num_draft_tokens=stats.num_draft_tokens,
        num_accepted_tokens=stats.num_accepted_tokens,
        num_suffix_draft_tokens=stats.num_suffix_draft_tokens,
        num_suffix_accepted_tokens=stats.num_suffix_accepted_tokens,
        num_forced_draft_tokens=stats.num_forced_draft_tokens,
        num_forced_accepted_tokens=stats.num_forced_accepted_tokens,
        num_cached_tokens=stats.num_cached_tokens,
        num_ahead_rounds=stats.num_ahead_rounds,
        mean_accepted_length=stats.mean_accepted_length,
        elapsed_seconds=stats.elapsed_s,
        tokens_per_second=stats.tokens_per_s,
        draft_seconds=stats.draft_s,
        verify_seconds=stats.verify_s,
    )
    for name, value in extra.items():  # the router's own counters, by field name (rpc_bytes, ...)
        setattr(message, name, value)
    return message


def costs_to_pb(verify_points: VerifyPoints, version: str) -> target_pb2.TargetCosts:
    verify = [target_pb2.VerifyCost(num_nodes=n, seconds=s) for n, s in verify_points]
    return target_pb2.TargetCosts(verify=verify, version=version)


def costs_from_pb(message: target_pb2.TargetCosts) -> VerifyPoints:
    """A replica's published verify curve, checked as a calibration is (increasing sizes, costs > 0)."""
    if not message.verify:
        raise InvalidArgument("the target published no verify costs")
    return verify_points_from_json({"verify_s": {str(c.num_nodes): c.seconds for c in message.verify}})


def suffix_trust_to_pb(account: SuffixTrust) -> target_pb2.SuffixTrust:
    message = target_pb2.SuffixTrust(
        trust=account.trust,
        mean_nodes=account.mean_nodes,
        mean_emitted=account.mean_emitted,
        suffix_nodes=sorted(account.suffix_nodes),
    )
    if account.predicted is not None:
        message.predicted = account.predicted
    return message


def suffix_trust_from_pb(message: target_pb2.SuffixTrust, num_nodes: int, max_nodes: int) -> SuffixTrust:
    """A suffix drafter's account as a peer sent it, checked: `num_nodes`, the nodes of the tree it comes
    with (its suffix nodes index that tree; 0: none may be named), `max_nodes` a tree's bound."""
    trust, mean_nodes, mean_emitted = message.trust, message.mean_nodes, message.mean_emitted
    if not (math.isfinite(trust) and SuffixTrust.MIN_TRUST <= trust <= SuffixTrust.MAX_TRUST):
        raise InvalidArgument(
            f"suffix trust must be in [{SuffixTrust.MIN_TRUST}, {SuffixTrust.MAX_TRUST}], got {trust}"
        )
    for name, mean in (("mean_nodes", mean_nodes), ("mean_emitted", mean_emitted)):
        if not (math.isfinite(mean) and 1.0 <= mean <= max_nodes):
            raise InvalidArgument(f"suffix {name} must be in [1, {max_nodes}], got {mean}")
    predicted = message.predicted if message.HasField("predicted") else None
    if predicted is not None and not (math.isfinite(predicted) and 0.0 <= predicted <= max_nodes):
        raise InvalidArgument(f"suffix predicted tokens must be in [0, {max_nodes}], got {predicted}")
    nodes = frozenset(message.suffix_nodes)
    if len(nodes) != len(message.suffix_nodes) or any(not 1 <= node < num_nodes for node in nodes):
        raise InvalidArgument(f"suffix nodes must be distinct tree nodes in [1, {num_nodes}), got {nodes}")
    return SuffixTrust(trust, mean_nodes, mean_emitted, predicted, nodes)
