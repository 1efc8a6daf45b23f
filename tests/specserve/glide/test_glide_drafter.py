"""GlideDrafter in the speculative loop: lossless greedy and sampling, CaPE trees, no target-cache copy.
Greedy losslessness and the draft state also on the Qwen2 tiny target, whose cached keys carry biases
and are wider (head_dim 16) than the draft's heads (8)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from scipy.stats import chisquare
from seeded_runs import seeded_runs
from tiny_llama import EACH_ARCHITECTURE, exact_joint_of_tokens_2_and_3, tiny_llama, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from specserve.core.cape import CapeSettings
from specserve.core.finish import FinishChecker
from specserve.core.loop import speculative_generate
from specserve.core.protocols import CandidateKind, DraftTree
from specserve.core.sampling_params import SamplingParams
from specserve.core.tree import tree_depths
from specserve.errors import FailedPrecondition
from specserve.glide import GlideDraft, GlideDrafter, build_glide
from specserve.glide.model import cross_mask_from_lengths, trained_cross_lengths
from specserve.models.tiny import Architecture
from specserve.runtime.drafter import DraftShape
from specserve.runtime.runner import ModelRunner
from specserve.runtime.target import LocalVerifier

PROMPT = [3, 17, 5, 9, 41, 2, 33, 8]
CAPACITY = 256
GREEDY = SamplingParams()


def _glide(target_model, seed: int = 0, std: float = 0.3, **overrides) -> GlideDraft:
    """A random draft; std 0.3 gives it confident and unsure steps, so CaPE widths vary."""
    draft = build_glide(target_model, seed=seed, **overrides)
    draft.init_weights(torch.Generator().manual_seed(seed), std=std)
    return draft


@pytest.fixture(scope="module")
def target(architecture):
    return ModelRunner(tiny_model(architecture))


@pytest.fixture(scope="module")
def glide(target):
    return _glide(target.model)


class Recording:
    """Wraps a drafter and keeps every tree it proposed."""

    def __init__(self, drafter: GlideDrafter) -> None:
        self.drafter, self.trees = drafter, []

    def propose(self, token_ids: Sequence[int], round_seed: int, batch_sessions: int) -> DraftTree:
        draft = self.drafter.propose(token_ids, round_seed, 1)
        self.trees.append(draft)
        return draft

    def observe(self, outcome) -> None:
        self.drafter.observe(outcome)

    def release(self) -> None:
        self.drafter.release()


def run(target, model, shape, cape, params, seed=0, prompt=PROMPT, max_new_tokens=40):
    verifier = LocalVerifier(target, CAPACITY, sampling=params)
    drafter = None
    if model is not None:
        drafter = Recording(GlideDrafter(model, verifier.cache, CAPACITY, shape, cape, params))
    finish = FinishChecker(max_new_tokens, frozenset())
    stats = speculative_generate(prompt, verifier, drafter, seed, finish)
    return finish.generated, stats, drafter


CASES = {
    "glide-chain": (DraftShape(depth=4), None, {}),
    "glide-cape": (DraftShape(depth=4), CapeSettings(), {}),
    "cape-capped": (DraftShape(depth=4), CapeSettings(max_tree_nodes=7), {}),
    "cape-reduced-head": (DraftShape(depth=4), CapeSettings(), {"draft_vocab_size": 16}),
    "cape-shared-embedding": (DraftShape(depth=3), CapeSettings(), {"share_target_embeddings": True}),
    "cape-two-blocks": (DraftShape(depth=4), CapeSettings(), {"num_layers": 2}),
    "cape-blocks-read-two-layers": (
        DraftShape(depth=4),
        CapeSettings(),
        {"num_layers": 2, "block_target_layers": (0, -1)},
    ),
}


# Every case on the Llama; on Qwen2 the ones that read the target's K/V differently.
QWEN2_CASES = ("glide-cape", "cape-shared-embedding", "cape-blocks-read-two-layers")
GREEDY_CASES = [(Architecture.LLAMA, case) for case in CASES] + [(Architecture.QWEN2, c) for c in QWEN2_CASES]


@pytest.mark.parametrize(("architecture", "case"), GREEDY_CASES, ids=str, scope="module")
def test_greedy_output_equals_target_alone(target, case):
    shape, cape, overrides = CASES[case]
    model = _glide(target.model, **overrides)
    reference, _, _ = run(target, None, None, None, GREEDY)
    generated, stats, drafter = run(target, model, shape, cape, GREEDY)
    assert generated == reference
    assert stats.num_draft_tokens > 0
    for draft in drafter.trees:
        assert max(tree_depths(draft.tree.parent_ids)) == shape.depth  # the spine always gets its depth
        if cape is not None:
            assert draft.tree.num_nodes <= cape.max_tree_nodes


def test_cape_tree_is_the_greedy_spine_plus_top_k_leaves(target, glide):
    _, _, drafter = run(target, glide, DraftShape(depth=4), CapeSettings(), GREEDY)
    widths_seen = set()
    for draft in drafter.trees:
        tree = draft.tree
        assert draft.kind is CandidateKind.FIXED and not draft.draft_probs  # no q on the wire
        depths = tree_depths(tree.parent_ids)
        spine = [0]
        for d in range(1, max(depths) + 1):
            level = [i for i, depth in enumerate(depths) if depth == d]
            assert all(tree.parent_ids[i] == spine[-1] for i in level)  # leaves hang off the spine
            assert len(level) in (8, 6, 4, 2)
            widths_seen.add(len(level))
            spine.append(level[0])  # the first candidate (top-1) carries the spine
    assert len(widths_seen) > 1  # confidences differ, so do the widths


# --- statistical losslessness of CaPE trees and chains at T > 0, 4-token vocabulary --------------

V = 4


@pytest.fixture(scope="module")
def small_target():
    return ModelRunner(tiny_llama(vocab_size=V, hidden=16, layers=1, seed=3))


@pytest.mark.compute_only
@pytest.mark.parametrize(
    "cape",
    [CapeSettings(), CapeSettings(bins=(2,) * 12), None],
    ids=["cape-official-bins", "cape-top2", "chain-sampled"],
)
def test_speculative_sampling_preserves_target_distribution(small_target, cape):
    """Tokens 2 and 3 come from the first speculative round (token 1 comes from the prefill)."""
    model = _glide(small_target.model, seed=4, std=1.0)
    prompt = [1, 2, 3, 0, 1]
    params = SamplingParams(temperature=1.0)
    trials = 3000

    def tokens(seed: int) -> list[int]:
        return run(small_target, model, DraftShape(depth=2), cape, params, seed, prompt, 3)[0]

    counts = torch.zeros(V, V)
    for generated in seeded_runs(tokens, trials):
        counts[generated[1], generated[2]] += 1
    expected = exact_joint_of_tokens_2_and_3(small_target.model, prompt, params, V) * trials
    result = chisquare(counts.flatten().numpy(), expected.flatten().numpy())
    assert result.pvalue > 1e-3, f"p={result.pvalue:.2e}"


# --- the draft state: a function of the committed sequence; the target cache read in place ---------


def _commit(target: ModelRunner, verifier: LocalVerifier, token_ids: list[int]) -> None:
    """Puts every token but the last (the root) into the target cache, as verification would."""
    missing = token_ids[verifier.cache.length : -1]
    if missing:
        target.forward(verifier.cache, missing)


@EACH_ARCHITECTURE
def test_draft_cache_depends_only_on_the_committed_sequence(target, glide):
    """Rounds of growth (1..5 tokens each) give the same root logits as one fresh encoding, and both
    equal one forward with the documented cross mask: committed tokens block-wise, the root sees all."""
    verifier = LocalVerifier(target, CAPACITY)
    drafter = GlideDrafter(glide, verifier.cache, CAPACITY, DraftShape(depth=4), CapeSettings())
    token_ids = list(PROMPT)
    g = torch.Generator().manual_seed(0)
    for grow in [3, 1, 5, 2, 4, 1]:
        _commit(target, verifier, token_ids)
        drafter.propose(token_ids, 0, 1)
        token_ids += torch.randint(0, 64, (grow,), generator=g).tolist()
    _commit(target, verifier, token_ids)
    target_kv = verifier.cache.layer_kv(-1)
    fresh = GlideDrafter(glide, verifier.cache, CAPACITY)
    root = len(token_ids) - 1
    visible = trained_cross_lengths(torch.arange(root + 1), glide.config.block_size)
    visible[-1] = root
    with torch.inference_mode():
        incremental = drafter._sync(token_ids, target_kv)
        from_scratch = fresh._sync(token_ids, target_kv)
        hidden = glide(torch.tensor([token_ids]), target_kv, cross_mask_from_lengths(visible, root))
        one_pass = glide.logits(hidden[0, -1])
    torch.testing.assert_close(incremental, from_scratch, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(incremental, one_pass, atol=1e-5, rtol=1e-5)


def test_each_block_reads_its_own_target_layer(target):
    """A draft whose blocks read target layers 0 and 1 gets exactly those layers' committed K/V."""
    glide = _glide(target.model, num_layers=2, block_target_layers=(0, -1))
    verifier = LocalVerifier(target, CAPACITY)
    drafter = GlideDrafter(glide, verifier.cache, CAPACITY)
    token_ids = [*PROMPT, 7]
    _commit(target, verifier, token_ids)
    root = len(token_ids) - 1
    visible = trained_cross_lengths(torch.arange(root + 1), glide.config.block_size)
    visible[-1] = root
    mask = cross_mask_from_lengths(visible, root)
    per_block = [verifier.cache.layer_kv(0), verifier.cache.layer_kv(1)]
    with torch.inference_mode():
        synced = drafter._sync(token_ids, per_block)
        expected = glide.logits(glide(torch.tensor([token_ids]), per_block, mask)[0, -1])
        swapped = glide.logits(glide(torch.tensor([token_ids]), per_block[::-1], mask)[0, -1])
        drafter.release()
        proposed = drafter.propose(token_ids, 0, 1)
    torch.testing.assert_close(synced, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(expected, swapped, atol=1e-3)  # the layers differ, so reading them does
    assert proposed.tree.token_ids[1] == int(expected.argmax())  # the drafter picks the same layers itself


class AliasWatch(TorchDispatchMode):
    """Records every aten op that receives a tensor living in one of `storages`."""

    def __init__(self, storages: set[int]) -> None:
        super().__init__()
        self.storages, self.ops = storages, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.storages:
                self.ops.append(func.overloadpacket.__name__)
                break
        return func(*args, **kwargs)


@EACH_ARCHITECTURE
def test_drafter_reads_the_target_cache_without_copying(target, glide):
    verifier = LocalVerifier(target, CAPACITY)
    drafter = GlideDrafter(glide, verifier.cache, CAPACITY, DraftShape(depth=4), CapeSettings())
    token_ids = [*PROMPT, verifier.prefill(PROMPT, 0)]
    last = verifier.cache.layers[-1]
    seen = []
    hook = glide.layers[0].cross_attn.register_forward_pre_hook(lambda module, args: seen.append(args[3:5]))
    watch = AliasWatch({last.keys.untyped_storage().data_ptr(), last.values.untyped_storage().data_ptr()})
    try:
        with watch:
            drafter.propose(token_ids, 0, 1)
    finally:
        hook.remove()
    assert len(seen) == 4  # sync + 3 spine steps
    for k, v in seen:  # the very buffers of the target's last layer
        assert k.data_ptr() == last.keys.data_ptr() and v.data_ptr() == last.values.data_ptr()
        assert k.shape[2] == len(PROMPT)
    # Only views and matrix products touch them: no clone, no repeat_interleave, no dtype cast.
    assert watch.ops and set(watch.ops) <= {"slice", "transpose", "view", "expand", "bmm", "matmul", "mm"}


def test_target_cache_out_of_step_is_refused(target, glide):
    verifier = LocalVerifier(target, CAPACITY)
    drafter = GlideDrafter(glide, verifier.cache, CAPACITY)
    verifier.prefill(PROMPT, 0)
    with pytest.raises(FailedPrecondition):
        drafter.propose([*PROMPT, 1, 2], 0, 1)  # the target has not verified token 1


def test_a_round_the_policy_sizes_to_nothing_runs_no_forward(target, glide):
    """Under load the cost policy may draft nothing: the drafter then returns the root alone, leaves
    its cache as it was, and catches up on the next round that drafts (same tree as a fresh drafter)."""
    verifier = LocalVerifier(target, CAPACITY)
    drafter = GlideDrafter(glide, verifier.cache, CAPACITY, DraftShape(depth=3))
    token_ids = list(PROMPT)
    _commit(target, verifier, token_ids)
    drafter.propose(token_ids, 0, 1)
    cached = drafter.cache.length
    token_ids += [5, 6]
    _commit(target, verifier, token_ids)

    class Nothing:  # a stop policy whose cap this round is 0
        max_depth = 0

        def observe(self, num_drafted: int, num_accepted: int) -> None: ...

    real, drafter.stop_policy = drafter.stop_policy, Nothing()
    draft = drafter.propose(token_ids, 0, 1)
    assert draft.tree.token_ids == (token_ids[-1],) and drafter.cache.length == cached
    drafter.stop_policy = real
    token_ids += [7]
    _commit(target, verifier, token_ids)
    fresh = GlideDrafter(glide, verifier.cache, CAPACITY, DraftShape(depth=3))
    assert drafter.propose(token_ids, 0, 1).tree == fresh.propose(token_ids, 0, 1).tree
