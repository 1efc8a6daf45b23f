"""One session of a method (the default unless `--method`) through a local stack, taken apart against
the same method in process: rounds, drafted and accepted tokens, and what each RPC costs beyond its handler.

Each prompt (the MT-Bench first turns, one per category, greedy) runs in process, then through the
stack; the outputs must be identical. From the stack's final message per prompt: target rounds,
drafted and accepted tokens, the draft's Propose time beyond its handler per round. Then, on the same
stack, a bare client's Verify of one token against the target, beyond the target's handler, and a call
that does nothing (Release of an unknown session). With `--budget`, where each side's seconds went:
each prompt's prefill is measured alone first (so the timed requests find the prompt in the prefix
caches), each request follows an untimed pause, and the seconds of the prefill, the rounds (in process
against inside the target's Verify handlers), the calls beyond their handlers, Redis and the rest are
printed. docs/benchmarks.md (the distributed stack) quotes:

    GOMP_SPINCOUNT=100 python scripts/diagnostics/stack_rounds.py --out /tmp/rounds
    python scripts/diagnostics/stack_rounds.py --out /tmp/rounds --budget
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from pathlib import Path

import grpc

from specserve.bench.prompts import load_prompts, per_category
from specserve.catalog import DEFAULT_METHOD
from specserve.client import Client
from specserve.core.request import GenerationRequest
from specserve.engine import Engine
from specserve.serving.stack import LocalStack
from specserve.v1 import common_pb2, target_pb2, target_pb2_grpc

CALLS = 80
PAUSE_SECONDS = 0.1  # with --budget, untimed, before each side's request (stack_ab.py says why)


def beyond_handler_ms(stub: target_pb2_grpc.TargetServiceStub) -> tuple[float, float]:
    """Medians (ms): a one-token Verify's round trip less the target's handler time; an empty call."""
    prefill = stub.Prefill(
        target_pb2.PrefillRequest(session_id="rounds", token_ids=list(range(100, 160)), capacity=600),
        timeout=30,
    )
    root, committed = prefill.next_token, prefill.committed_length + 1
    verify, empty = [], []
    for _ in range(CALLS):
        tree = common_pb2.DraftTree(token_ids=[root], parent_ids=[-1], kind=common_pb2.CANDIDATE_KIND_FIXED)
        start = time.perf_counter()
        response = stub.Verify(
            target_pb2.VerifyRequest(session_id="rounds", tree=tree, committed_length=committed), timeout=10
        )
        verify.append(time.perf_counter() - start - response.handler_seconds)
        root, committed = response.next_token, response.committed_length
        start = time.perf_counter()
        stub.Release(target_pb2.ReleaseRequest(session_id="nobody"), timeout=10)
        empty.append(time.perf_counter() - start)
    stub.Release(target_pb2.ReleaseRequest(session_id="rounds"), timeout=10)
    return 1e3 * statistics.median(verify), 1e3 * statistics.median(empty)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the stack's logs go here")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--budget", action="store_true", help="also where each side's seconds went")
    parser.add_argument("--method", default=DEFAULT_METHOD, help="the method, in process and on the stack")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    engine = Engine()
    request = GenerationRequest.build(method=args.method, max_new_tokens=args.max_new_tokens)
    first_token = GenerationRequest.build(method=args.method, max_new_tokens=1)
    in_process, stack_side = Counter(), Counter()
    with LocalStack(log_dir=args.out) as stack, Client(stack.router_address) as client:
        engine.generate("warm up", GenerationRequest.build(method=args.method, max_new_tokens=8))
        client.generate("warm up", method=args.method, max_new_tokens=8)
        for prompt in per_category(load_prompts(), 1):
            if args.budget:
                # The prefill alone first (one-token requests, outside the timed ones): what the rounds
                # after it cost is the whole request's verify time less it. The second of two, like the
                # timed request after them, finds the prompt in its side's prefix cache.
                for _ in range(2):
                    local_prefill = engine.generate(prompt.text, first_token).stats.verify_s
                    remote = client.generate(prompt.text, method=args.method, max_new_tokens=1)
                    remote_prefill = remote.stats["verify_seconds"]
                in_process["prefill"] += local_prefill
                stack_side["prefill"] += remote_prefill
                time.sleep(PAUSE_SECONDS)
            start = time.perf_counter()
            local = engine.generate(prompt.text, request)
            in_process["seconds"] += time.perf_counter() - start
            in_process["rounds"] += local.stats.num_target_forwards
            in_process["drafted"] += local.stats.num_draft_tokens
            in_process["accepted"] += local.stats.num_accepted_tokens
            in_process["verify"] += local.stats.verify_s
            in_process["draft"] += local.stats.draft_s
            time.sleep(PAUSE_SECONDS if args.budget else 0.0)
            start = time.perf_counter()
            remote = client.generate(
                prompt.text, method=args.method, max_new_tokens=args.max_new_tokens, temperature=0.0
            )
            stack_side["seconds"] += time.perf_counter() - start
            if remote.token_ids != local.token_ids:
                raise SystemExit(f"the stack's output differs from in process on {prompt.category!r}")
            stats = remote.stats
            stack_side["rounds"] += int(stats["num_target_forwards"])
            stack_side["drafted"] += int(stats["num_draft_tokens"])
            stack_side["accepted"] += int(stats["num_accepted_tokens"])
            stack_side["propose beyond handler"] += stats["draft_seconds"] - stats["draft_service_seconds"]
            stack_side["redis"] += stats["redis_seconds"]
            stack_side["verify"] += stats["verify_seconds"]  # the Prefill call and every Verify call
            stack_side["handlers"] += stats["target_service_seconds"]  # inside the Verify handlers
            stack_side["draft"] += stats["draft_seconds"]
            stack_side["elapsed"] += stats["elapsed_seconds"]  # the router's loop, start to end
        with grpc.insecure_channel(stack.address("target")) as channel:
            verify_ms, empty_ms = beyond_handler_ms(target_pb2_grpc.TargetServiceStub(channel))
    for name, side in (("in process", in_process), ("stack", stack_side)):
        print(
            f"{name}: {side['seconds']:.2f} s, {side['rounds']} rounds "
            f"({1e3 * side['seconds'] / side['rounds']:.1f} ms each), "
            f"{side['drafted']} drafted, {side['accepted']} accepted"
        )
    rounds = stack_side["rounds"]
    propose_ms = 1e3 * stack_side["propose beyond handler"] / rounds
    print(f"per stack round: Propose beyond the draft's handler {propose_ms:.2f} ms, Redis ", end="")
    print(f"{1e3 * stack_side['redis'] / rounds:.2f} ms")
    print(
        f"bare client: Verify beyond the target's handler {verify_ms:.2f} ms, an empty call {empty_ms:.2f} ms"
    )
    print(f"stack / in process: {in_process['seconds'] / stack_side['seconds']:.3f}x")
    if args.budget:
        print_budget(in_process, stack_side)


def print_budget(in_process: Counter, stack_side: Counter) -> None:
    """Where each side's seconds went (the prefills measured alone, so approximately): the rounds after
    the prefill, in process against inside the target's Verify handlers, then what the stack adds."""
    local_rounds = in_process["verify"] - in_process["prefill"]
    verify_calls = stack_side["verify"] - stack_side["prefill"]
    print("seconds over the prompts, in process / stack:")
    print(f"  prefill: {in_process['prefill']:.3f} / {stack_side['prefill']:.3f} (the Prefill call)")
    print(f"  the rounds' verify: {local_rounds:.3f} / {stack_side['handlers']:.3f} (inside the handlers)")
    print(f"  drafting in the loop: {in_process['draft']:.3f} / {stack_side['draft']:.3f} (Propose calls)")
    print(f"  Verify calls beyond their handlers: - / {verify_calls - stack_side['handlers']:.3f}")
    print(f"  Redis: - / {stack_side['redis']:.3f}")
    loop_rest = stack_side["elapsed"] - stack_side["verify"] - stack_side["draft"] - stack_side["redis"]
    local_rest = in_process["seconds"] - in_process["verify"] - in_process["draft"]
    print(f"  the rest of the loop and the request: {local_rest:.3f} / {loop_rest:.3f} (the router's loop)")
    print(f"  + {stack_side['seconds'] - stack_side['elapsed']:.3f} (the client's wall time beyond it)")


if __name__ == "__main__":
    main()
