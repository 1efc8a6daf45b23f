from __future__ import annotations

from pathlib import Path

import pytest

from specserve.grammar import GrammarCompiler

EOS = 2  # SmolLM2's <|im_end|>


@pytest.fixture(scope="session")
def compiler(default_model_dir: Path) -> GrammarCompiler:
    """Constraints compiled against the default model's real tokenizer."""
    return GrammarCompiler((default_model_dir / "tokenizer.json").read_text(), [EOS])
