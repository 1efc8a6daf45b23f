"""How far a cheaper separate draft could take a chain's speed: the draft's agreement with the served
target at fewer bits or fewer layers, against what its step would save.

The served target (as the engine runs it) answers MT-Bench first turns greedily; each draft variant then
reads prompt and answer in one teacher-forced pass, and its greedy choice at each answer position is
compared with the target's next token. Under greedy decoding a chain of k drafts is accepted up to its
first disagreement, and a draft that agrees has the target's own token before it, so the teacher-forced
rates are the chain's acceptance exactly: a round of a chain of k yields 1 + sum_j P(the first j agree)
tokens. The variants round the draft's float weights per group of inputs to `bits` bits (a scale and a
minimum per group, in fp16, as Q4_1 keeps them: `bits=4` is the served 4-bit draft's rounding, computed
in float32 here rather than on the int8-row kernel), and may drop layers. The head keeps the served
draft's rows (runtime/draft_head.py).

The same run times the served target's one-token step, its verify of a chain of k + 1 tokens and the
served draft's one-token step, its decoder layers apart; a variant's step is the served draft's with the
layers' part scaled by the bytes they stream (a draft step is paced by memory: docs/benchmarks.md, "A
4-bit draft"), the head and the rest unchanged. Then, per variant
and chain length, tokens a round and tokens per target step:
tokens / (k * draft step + verify(k + 1)), in target steps. docs/benchmarks.md ("Cheaper drafts for the
1.5B, measured before built") quotes:

    python scripts/diagnostics/draft_agreement.py --model qwen2.5-coder-1.5b-instruct \
        --out docs/results/draft-agreement-qwen1.5b.json --plot docs/results/draft-agreement-qwen1.5b.png
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import ab_step  # the same chains as the A/B script
import forward_parts  # its timing wrapper

from specserve.bench.prompts import load_prompts, per_category
from specserve.core.request import GenerationRequest
from specserve.engine import Engine
from specserve.models import load_causal_lm
from specserve.runtime import calibrate, fused_layers
from specserve.runtime.draft_head import kept_token_ids
from specserve.settings import EngineSettings

SCALE_BITS = 32  # a group's fp16 scale and fp16 minimum
CHAINS = (1, 2, 3, 4)


@dataclass(frozen=True)
class Variant:
    name: str
    bits: int | None  # None: the float weights
    group: int = 32
    skip: tuple[int, ...] = ()


VARIANTS = (
    Variant("float32", None),
    Variant("4 bits (served)", 4),
    Variant("3 bits", 3),
    Variant("3 bits, groups of 16", 3, 16),
    Variant("2 bits, groups of 16", 2, 16),
    Variant("4 bits, layer 4 dropped", 4, skip=(4,)),
    Variant("4 bits, layer 12 dropped", 4, skip=(12,)),
    Variant("4 bits, layers 4 and 12 dropped", 4, skip=(4, 12)),
)


def rounded(weight: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """[N, K] -> the same shape, each group of `group` inputs rounded to 2**bits levels between its
    minimum and maximum (Q4_1's rounding at 4 bits)."""
    n, k = weight.shape
    grouped = weight.reshape(n, k // group, group)
    low, high = grouped.amin(-1, keepdim=True), grouped.amax(-1, keepdim=True)
    levels = 2**bits - 1
    step = torch.where(high > low, (high - low) / levels, torch.ones_like(high))
    codes = torch.clamp(torch.round((grouped - low) / step), 0, levels)
    return (codes * step + low).reshape(n, k)


def draft_variant(base: nn.Module, variant: Variant) -> nn.Module:
    model = copy.deepcopy(base)
    with torch.no_grad():
        if variant.bits is not None:
            for name, module in model.named_modules():
                if isinstance(module, nn.Linear) and "lm_head" not in name:
                    module.weight.copy_(rounded(module.weight, variant.bits, variant.group))
            embedding = model.get_input_embeddings().weight  # the tied head: the served draft's 4 bits
            embedding.copy_(rounded(embedding, 4, 32))
    if variant.skip:
        kept = [layer for i, layer in enumerate(model.model.layers) if i not in variant.skip]
        for i, layer in enumerate(kept):
            layer.self_attn.layer_idx = i
        model.model.layers = nn.ModuleList(kept)
        model.config.num_hidden_layers = len(kept)
    return model


def layer_bytes(model: nn.Module, variant: Variant) -> float:
    """Bytes the variant's decoder layers stream a step (their linear weights with a group's factors)."""
    weights = sum(
        module.weight.numel()
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and "lm_head" not in name
    )
    bits = (variant.bits or 32) + (SCALE_BITS / variant.group if variant.bits else 0)
    return weights * bits / 8


@torch.inference_mode()
def agreement(model: nn.Module, answers: list[dict[str, list[int]]], keep: torch.Tensor) -> list[float]:
    """P(the first j drafts of a chain agree) for j in CHAINS, over every answer position."""
    hits = [0] * len(CHAINS)
    positions = 0
    for answer in answers:
        prompt, tokens = answer["prompt"], answer["answer"]
        logits = model(torch.tensor([prompt + tokens])).logits[0]  # [T, V]
        logits[:, ~keep] = float("-inf")
        choice = logits[len(prompt) - 1 : -1].argmax(-1).tolist()  # the draft's pick for each answer token
        agree = [int(c == t) for c, t in zip(choice, tokens, strict=True)]
        for start in range(len(agree) - max(CHAINS) + 1):
            positions += 1
            run = 0
            while run < max(CHAINS) and agree[start + run]:
                run += 1
            for i, j in enumerate(CHAINS):
                hits[i] += run >= j
    return [h / positions for h in hits]


def round_robin(steps: dict[int, Callable[[], object]], repeats: int) -> dict[int, float]:
    """Each step's median milliseconds, the steps taken in turn `repeats` times."""
    for step in steps.values():
        step()
    times: dict[int, list[float]] = {key: [] for key in steps}
    for _ in range(repeats):
        for key, step in steps.items():
            start = time.perf_counter()
            step()
            times[key].append(time.perf_counter() - start)
    return {key: statistics.median(values) * 1e3 for key, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="a profile with a draft model")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=60, help="timed forwards per cost")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    engine = Engine(EngineSettings.from_env(model=args.model))
    if engine.draft_model_dir is None:
        parser.error(f"{args.model} has no separate draft model")
    request = GenerationRequest.build(method="target", max_new_tokens=args.max_new_tokens)
    answers = []
    for prompt in per_category(load_prompts(), args.per_category):
        ids = engine.encode_prompt(prompt.text)
        answers.append({"prompt": ids, "answer": engine.generate_ids(ids, request).token_ids})
    print(f"{len(answers)} answers of the served target, {sum(len(a['answer']) for a in answers)} tokens")

    with torch.inference_mode():
        # round robin over the forwards, so a drift of the host's speed reaches every one alike
        steps = {0: ab_step.tree_step(engine.vanilla_draft_runner, calibrate, 1)}
        for k in (0, *CHAINS):  # key k + 1: the target's forward of a chain of k + 1 tokens
            steps[k + 1] = ab_step.tree_step(engine.target_runner, calibrate, k + 1, chain=True)
        times = round_robin(steps, args.repeats)
        spent: dict[str, float] = {}
        forward_parts.wrap(fused_layers.FusedLayers, "forward", "layers", spent)
        start = time.perf_counter()
        for _ in range(args.repeats):
            steps[0]()
        draft, target = times[0], times[1]
        layers = draft * spent["layers"] / (time.perf_counter() - start)  # the layers' share of a step
        verify = {k: times[k + 1] / target for k in CHAINS}
    print(
        f"target step {target:.2f} ms, served draft step {draft:.2f} ms ({layers:.2f} ms its layers); "
        "verify(k + 1) in target steps:"
    )
    print("  " + ", ".join(f"k={k}: {v:.3f}" for k, v in verify.items()))

    base = load_causal_lm(engine.draft_model_dir, dtype="float32")
    vocab = base.config.vocab_size
    keep = torch.zeros(vocab, dtype=torch.bool)
    rows = engine.draft_head_rows or vocab
    keep[kept_token_ids(vocab, rows, engine.special_token_ids)] = True
    served_bytes = layer_bytes(base, Variant("", 4))
    rows_out = []
    for variant in VARIANTS:
        model = draft_variant(base, variant)
        rates = agreement(model, answers, keep)
        scale = layer_bytes(model, variant) / served_bytes if variant.bits else None
        step = None if scale is None else draft - layers + layers * scale
        row = {"variant": variant.name, "agree": dict(zip(map(str, CHAINS), rates, strict=True))}
        row["layer_bytes_vs_served"] = scale
        row["draft_step_vs_target"] = None if step is None else step / target
        row["tokens_per_round"] = {str(k): 1 + sum(rates[: CHAINS.index(k) + 1]) for k in CHAINS}
        if step is not None:
            row["tokens_per_target_step"] = {
                str(k): row["tokens_per_round"][str(k)] / (k * step / target + verify[k]) for k in CHAINS
            }
        rows_out.append(row)
        best = row.get("tokens_per_target_step")
        print(
            f"{variant.name:34s} agree {' '.join(f'{r:.3f}' for r in rates)}"
            + (f"  bytes x{scale:.2f}" if scale else "")
            + (f"  tokens/target step {' '.join(f'{best[str(k)]:.3f}' for k in CHAINS)}" if best else ""),
            flush=True,
        )
        del model
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "model": args.model,
                "answers": len(answers),
                "target_step_ms": target,
                "served_draft_step_ms": draft,
                "served_draft_layers_ms": layers,
                "verify_chain": {str(k): v for k, v in verify.items()},
                "variants": rows_out,
            },
            indent=1,
        )
    )
    if args.plot:
        plot(rows_out, args.plot)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for row in rows:
        if "tokens_per_target_step" not in row:
            continue
        values = [row["tokens_per_target_step"][str(k)] for k in CHAINS]
        ax.plot(CHAINS, values, marker="o", label=row["variant"])
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xlabel("drafted tokens a round (a chain)")
    ax.set_ylabel("tokens per target step (estimated)")
    ax.set_xticks(list(CHAINS))
    ax.set_title("Cheaper drafts for the 1.5B: agreement measured, step priced by its bytes")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
