"""How much of a target's own answers a draft head cut to the first N token ids can still propose.

Reads (or generates once) the target's greedy answers to MT-Bench first turns, the same held-out set and
cache as `specserve eval-draft`, and prints the share of answer tokens whose id is below N or is a
special token (the ids `runtime/draft_head.py` keeps). docs/benchmarks.md ("A cheaper draft step")
quotes:

    python scripts/diagnostics/vocab_coverage.py --model qwen2.5-coder-1.5b-instruct --per-category 2
"""

from __future__ import annotations

import argparse

from specserve.bench.prompts import load_prompts, per_category
from specserve.models import load_causal_lm, load_tokenizer, resolve_model_dir
from specserve.runtime.draft_head import kept_token_ids
from specserve.settings import EngineSettings
from specserve.training.evaluate import held_out_answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model profile (default: the default model)")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rows", default="16384,32768,65536", help="comma-separated head sizes")
    args = parser.parse_args()
    settings = EngineSettings.from_env(model=args.model)
    model_dir = resolve_model_dir(settings.model_dir, settings.cache_dir, settings.model)
    tokenizer = load_tokenizer(model_dir)
    prompts = [p.text for p in per_category(load_prompts(), args.per_category)]
    cache = settings.cache_dir / f"eval-answers-{model_dir.name}-{len(prompts)}x{args.max_new_tokens}.json"
    target = None if cache.is_file() else load_causal_lm(model_dir)  # answers cached: no model needed
    sequences, starts = held_out_answers(target, tokenizer, prompts, args.max_new_tokens, cache)  # type: ignore[arg-type]
    answers = [token for sequence, start in zip(sequences, starts, strict=True) for token in sequence[start:]]
    vocab = len(tokenizer)
    print(f"{model_dir.name}: {len(answers)} answer tokens of {len(prompts)} prompts, vocabulary {vocab}")
    for rows in (int(r) for r in args.rows.split(",")):
        kept = set(kept_token_ids(vocab, rows, tokenizer.all_special_ids).tolist())
        share = sum(token in kept for token in answers) / len(answers)
        print(f"  first {rows:>6} ids + special tokens: {share:.1%} of answer tokens")


if __name__ == "__main__":
    main()
