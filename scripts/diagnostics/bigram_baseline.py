"""A bigram table's agreement with the target on the held-out answers `specserve eval-draft` scores.

For each input token, the most frequent target label after it in the training rows; scored on the same
answer positions as eval-draft (after the first block of 5). docs/training.md quotes it:
    python scripts/diagnostics/bigram_baseline.py runs/draft-data
(run `specserve eval-draft` once first: it writes the cached answers this reads).
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

import pyarrow.parquet as pq

from specserve.models import default_model_dir, load_causal_lm
from specserve.settings import EngineSettings
from specserve.training.features import pad_rows, target_features

SKIPPED = 5  # eval-draft never scores the first block (block size 5)


def bigram_table(data_dir: Path) -> dict[int, int]:
    counts: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for shard in sorted((data_dir / "features").glob("*.parquet")):
        rows = pq.read_table(shard, columns=["input_ids", "labels"]).to_pydict()
        for ids, labels in zip(rows["input_ids"], rows["labels"], strict=True):
            for token, label in zip(ids, labels, strict=True):
                if label >= 0:
                    counts[token][label] += 1
    return {token: c.most_common(1)[0][0] for token, c in counts.items()}


def main(data_dir: Path) -> None:
    cache_dir = EngineSettings.from_env().cache_dir
    model_dir = default_model_dir(cache_dir)
    answers = sorted(cache_dir.glob(f"eval-answers-{model_dir.name}-*.json"))
    if not answers:
        sys.exit("no cached eval-draft answers: run `specserve eval-draft` first")
    record = json.loads(answers[0].read_text())
    table = bigram_table(data_dir)
    target = load_causal_lm(model_dir)
    agreed = scored = 0
    for sequence, start in zip(record["sequences"], record["answer_starts"], strict=True):
        ids = pad_rows([sequence], len(sequence), 0)
        labels = target_features(target, ids, [len(sequence)], -1)["labels"][0].tolist()
        for t in range(max(start, SKIPPED), len(sequence)):
            scored += 1
            agreed += table.get(sequence[t]) == labels[t]
    print(f"bigram agreement {agreed / scored:.3f} over {scored} answer positions ({answers[0].name})")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/draft-data"))
