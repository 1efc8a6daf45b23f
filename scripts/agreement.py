"""How often two methods' greedy outputs agree, from `specserve bench --out` result files.

    python scripts/agreement.py A.json:METHOD B.json:METHOD

Prints how many prompts' token ids are identical and the mean length of their common prefix (the
tokens generated before the first difference). The files must hold the same prompts in the same order
(the same --prompts / --per-category / --limit), e.g. `target` of a `--weights as-shipped` run against
`target` of a `--weights dense` run: how often the quantized target's greedy output equals float32's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def outputs(spec: str) -> list[list[int]]:
    path, _, method = spec.rpartition(":")
    result = json.loads(Path(path).read_text())
    return [o["token_ids"] for o in result["methods"][method]["outputs"]]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    first, second = outputs(sys.argv[1]), outputs(sys.argv[2])
    if len(first) != len(second):
        sys.exit(f"the files hold {len(first)} and {len(second)} prompts: not the same run")
    identical = sum(a == b for a, b in zip(first, second, strict=True))
    prefixes = [common_prefix(a, b) for a, b in zip(first, second, strict=True)]
    mean = sum(prefixes) / len(prefixes)
    print(f"identical {identical}/{len(first)}, mean common prefix {mean:.1f} tokens")


if __name__ == "__main__":
    main()
