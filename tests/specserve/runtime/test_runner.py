"""ModelRunner over a positional KV cache: chains, trees and commits equal plain forwards, on each
architecture's tiny model (Llama; Qwen2 with biased q/k/v and heads wider than hidden / heads); a
forward off the thread that loaded the model is logged."""

import logging
import threading

import pytest
import torch
from tiny_llama import EACH_ARCHITECTURE, tiny_model
from tree_paths import path_to_node

from specserve.errors import ResourceExhausted
from specserve.runtime.runner import ModelRunner

PROMPT = [3, 17, 5, 9, 41, 2, 33, 8]


@pytest.fixture(scope="module")
def model(architecture):
    return tiny_model(architecture)


def _reference_logits(model, token_ids):
    with torch.inference_mode():
        return model(torch.tensor([token_ids])).logits[0]  # [n, V]


@EACH_ARCHITECTURE
def test_chain_logits_match_plain_forward(model):
    runner = ModelRunner(model)
    cache = runner.new_cache(32)
    pieces = [
        runner.forward(cache, PROMPT[:5]),
        runner.forward(cache, PROMPT[5:6]),
        runner.forward(cache, PROMPT[6:]),
    ]
    torch.testing.assert_close(torch.cat(pieces), _reference_logits(model, PROMPT), atol=1e-4, rtol=1e-4)
    assert cache.length == len(PROMPT)


@EACH_ARCHITECTURE
def test_tree_node_logits_match_their_path_run_as_a_chain(model):
    runner = ModelRunner(model)
    cache = runner.new_cache(32)
    runner.forward(cache, PROMPT[:6])
    tokens, parents = [PROMPT[6], 11, 12, 13, 14, 15, 16], [-1, 0, 0, 1, 1, 2, 3]
    logits = runner.forward(cache, tokens, parents)  # [7, V]
    for node in range(len(tokens)):
        path = [tokens[i] for i in path_to_node(parents, node)]
        expected = _reference_logits(model, PROMPT[:6] + path)[-1]
        torch.testing.assert_close(logits[node], expected, atol=1e-4, rtol=1e-4)


@EACH_ARCHITECTURE
def test_commit_compacts_the_accepted_path(model):
    runner = ModelRunner(model)
    cache = runner.new_cache(32)
    runner.forward(cache, PROMPT[:6])
    tokens, parents = [PROMPT[6], 11, 12, 13, 14], [-1, 0, 0, 2, 3]
    runner.forward(cache, tokens, parents)
    cache.commit_path(6, [0, 2, 3])  # keep root -> 12 -> 13
    assert cache.length == 9
    after = runner.forward(cache, [20], last_only=True)
    expected = _reference_logits(model, [*PROMPT[:6], PROMPT[6], 12, 13, 20])[-1]
    torch.testing.assert_close(after, expected, atol=1e-4, rtol=1e-4)


def test_capacity_is_enforced(model):
    runner = ModelRunner(model)
    cache = runner.new_cache(4)
    with pytest.raises(ResourceExhausted):
        runner.forward(cache, PROMPT)


def _forward_on_a_thread(runner: ModelRunner) -> None:
    def run() -> None:
        with torch.inference_mode():
            runner.forward(runner.new_cache(8), PROMPT[:3])

    thread = threading.Thread(target=run, name="other-thread")
    thread.start()
    thread.join()


def test_a_forward_off_the_loading_thread_is_logged_once(model, caplog):
    runner = ModelRunner(model)  # loaded here, on the test's thread, which stays alive
    with caplog.at_level(logging.WARNING, logger="specserve.runtime.runner"):
        _forward_on_a_thread(runner)
        _forward_on_a_thread(runner)
    warnings = [r.getMessage() for r in caplog.records if r.name == "specserve.runtime.runner"]
    assert len(warnings) == 1
    assert "other-thread" in warnings[0] and threading.current_thread().name in warnings[0]


def test_forwards_on_the_loading_thread_or_after_it_ended_are_not_logged(model, caplog):
    with caplog.at_level(logging.WARNING, logger="specserve.runtime.runner"):
        here = ModelRunner(model)
        with torch.inference_mode():
            here.forward(here.new_cache(8), PROMPT[:3])
        built: list[ModelRunner] = []
        loader = threading.Thread(target=lambda: built.append(ModelRunner(model)))
        loader.start()
        loader.join()  # the loading thread has ended: its OpenMP team went with it
        _forward_on_a_thread(built[0])
    assert not [r for r in caplog.records if r.name == "specserve.runtime.runner"]
