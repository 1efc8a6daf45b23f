"""llguidance against xgrammar on this CPU, for the json-extraction workload's schemas.

For each engine and tokenizer: the tokenizer's one-time setup, each schema's first compile (median over
the 16 schemas), the next-token mask along a real answer (the schema's example record as json.dumps writes
it, tokenized; median per token), and how many of the answer's tokens the engine forces (llguidance's
fast-forward tokens, xgrammar's jump-forward string, tokenized). Both take JSON in the same layout (", "
and ": ", no other whitespace). docs/structured-output.md quotes:

    python scripts/diagnostics/grammar_engines.py                      # the default model's tokenizer
    python scripts/diagnostics/grammar_engines.py --model qwen2.5-coder-1.5b-instruct

xgrammar is not a dependency: install it beside (`pip install --no-deps --target DIR xgrammar==0.2.8
apache-tvm-ffi`, then PYTHONPATH=DIR); without it the script measures llguidance alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from specserve.bench.prompts import load_prompts
from specserve.grammar.schema import json_schema_constraint
from specserve.models import load_tokenizer
from specserve.settings import EngineSettings

EXAMPLES = {  # one record per schema family of the workload
    "person": {
        "name": "Ann Lee",
        "age": 41,
        "occupation": "teacher",
        "city": "Oslo",
        "languages": ["English"],
    },
    "product": {"name": "Lamp", "brand": "Lumo", "price_usd": 45.5, "in_stock": True, "colors": ["white"]},
    "event": {
        "title": "Day",
        "date": "2027-03-14",
        "venue": "Hall",
        "city": "Granada",
        "speakers": ["Ana Ruiz"],
    },
    "book": {"title": "Salt", "author": "Lina Haddad", "year": 1998, "pages": 410, "genres": ["novel"]},
}


def _ms(f: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    value = f()
    return (time.perf_counter() - start) * 1e3, value


def llguidance_engine(
    tokenizer_json: str, eos: list[int], schemas: list[dict], answers: list[list[int]]
) -> dict:
    from specserve.grammar import GrammarCompiler

    setup_ms, compiler = _ms(lambda: GrammarCompiler(tokenizer_json, eos))
    compile_ms, mask_us, forced = [], [], 0
    for schema, answer in zip(schemas, answers, strict=True):
        compiler._compiled.clear()  # a first compile each time, as xgrammar's below (its cache off)
        ms, guide = _ms(lambda s=schema: compiler.guide(json_schema_constraint(s), 0, 64))
        compile_ms.append(ms)
        position = 0
        while position < len(answer):
            t0 = time.perf_counter()
            guide.bitmask()
            mask_us.append((time.perf_counter() - t0) * 1e6)
            ahead = guide.forced()
            if ahead and answer[position : position + len(ahead)] == ahead:
                forced += len(ahead)
                guide.push(ahead)
                position += len(ahead)
                continue
            guide.push([answer[position]])
            position += 1
    return _row("llguidance 1.9.1", setup_ms, compile_ms, mask_us, forced, sum(map(len, answers)))


def xgrammar_engine(
    hf_tokenizer, vocab_size: int, schemas: list[dict], answers: list[list[int]]
) -> dict | None:
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    setup_ms, info = _ms(lambda: xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size))
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    compile_ms, mask_us, forced = [], [], 0
    for schema, answer in zip(schemas, answers, strict=True):
        ms, compiled = _ms(
            lambda s=schema: compiler.compile_json_schema(
                json.dumps(s), any_whitespace=False, separators=(", ", ": "), strict_mode=True
            )
        )
        compile_ms.append(ms)
        matcher = xgr.GrammarMatcher(compiled)
        position = 0
        while position < len(answer):
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            mask_us.append((time.perf_counter() - t0) * 1e6)
            jump = matcher.find_jump_forward_string()
            ahead = hf_tokenizer.encode(jump, add_special_tokens=False) if jump else []
            if ahead and answer[position : position + len(ahead)] == ahead:
                forced += len(ahead)
                for token in ahead:
                    matcher.accept_token(token)
                position += len(ahead)
                continue
            matcher.accept_token(answer[position])
            position += 1
    return _row("xgrammar 0.2.8", setup_ms, compile_ms, mask_us, forced, sum(map(len, answers)))


def _row(
    name: str, setup_ms: float, compile_ms: list[float], mask_us: list[float], forced: int, total: int
) -> dict:
    return {
        "engine": name,
        "tokenizer_setup_ms": round(setup_ms, 1),
        "compile_ms_median": round(statistics.median(compile_ms), 2),
        "compile_ms_max": round(max(compile_ms), 2),
        "mask_us_median": round(statistics.median(mask_us), 1),
        "mask_us_p90": round(sorted(mask_us)[int(0.9 * len(mask_us))], 1),
        "forced_tokens": f"{forced}/{total}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model profile (default: the default model)")
    args = parser.parse_args()
    settings = EngineSettings.from_env() if args.model is None else EngineSettings(model=args.model)
    from specserve.runtime.target_runtime import TargetRuntime

    runtime = TargetRuntime(settings)
    model_dir = Path(runtime.model_dir)
    hf_tokenizer = load_tokenizer(model_dir)
    tokenizer_json = hf_tokenizer.backend_tokenizer.to_str()
    eos = sorted(runtime.eos_token_ids)
    vocab_size = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    prompts = load_prompts("json-extraction")
    schemas = [json.loads(p.constraint.source) for p in prompts if p.constraint is not None]
    answers = [
        hf_tokenizer.encode(json.dumps(EXAMPLES[p.category]), add_special_tokens=False) + eos[:1]
        for p in prompts
    ]
    rows = [llguidance_engine(tokenizer_json, eos, schemas, answers)]
    other = xgrammar_engine(hf_tokenizer, vocab_size, schemas, answers)
    rows += [other] if other is not None else []
    print(
        f"model: {model_dir.name}, vocabulary {vocab_size}, {len(schemas)} schemas, "
        f"{sum(map(len, answers))} tokens"
    )
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
