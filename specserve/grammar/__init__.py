"""Constrained generation: constraints (core/constraint.py) compiled with llguidance against a model's
tokenizer (`GrammarCompiler`), and a session's position in its language (`Guide`). Torch-free, so the
router compiles and walks constraints too; the target's masks over logits are in `masks.py`."""

from specserve.grammar.compiler import GrammarCompiler
from specserve.grammar.guide import Guide

__all__ = ["GrammarCompiler", "Guide"]
