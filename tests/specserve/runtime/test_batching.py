"""The continuous-batching scheduler: forwards merged across jobs, FIFO under a token budget, jobs
joining and leaving between forwards, cancellation, failures kept to their own jobs."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest
import torch

from specserve.errors import Cancelled, InvalidArgument, ResourceExhausted
from specserve.runtime.batching import (
    Scheduler,
    SchedulerThread,
    batched_call,
    unbatched,
    wait_until,
)


class Recorder:
    """A fake 'model' that records each forward's segments; a segment is (job name, tokens)."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []

    def forward_batch(self, segments: Sequence[Segment]) -> list[str]:
        if any(s.name == "boom" for s in segments):
            raise InvalidArgument("a bad segment")
        self.batches.append([s.name for s in segments])
        return [f"{s.name}:{len(self.batches)}" for s in segments]


class Segment:
    def __init__(self, name: str, num_tokens: int = 1) -> None:
        self.name, self.num_tokens = name, num_tokens


def steps(model: Recorder, name: str, count: int, tokens: int = 1):
    return lambda: [batched_call(model, Segment(name, tokens)) for _ in range(count)]


def test_outside_a_job_a_call_runs_alone():
    model = Recorder()
    assert batched_call(model, Segment("a")) == "a:1"
    assert model.batches == [["a"]]


def test_a_job_inside_unbatched_runs_its_forwards_alone_and_keeps_the_thread():
    """A measurement a session's first round starts runs its own forwards while the others wait."""
    model = Recorder()

    def measuring() -> list[str]:
        batched_call(model, Segment("m"))  # a round's forward before the measurement, merged
        with unbatched():
            timed = [batched_call(model, Segment("timed")) for _ in range(3)]
        return [*timed, batched_call(model, Segment("m"))]

    results = Scheduler().run_all([steps(model, "a", 3), measuring])
    assert model.batches == [["a", "m"], ["timed"], ["timed"], ["timed"], ["a", "m"], ["a"]]
    assert results[1] == ["timed:2", "timed:3", "timed:4", "m:5"]


def test_jobs_share_forwards_and_leave_when_done():
    model = Recorder()
    results = Scheduler().run_all([steps(model, "a", 1), steps(model, "b", 3), steps(model, "c", 2)])
    assert model.batches == [["a", "b", "c"], ["b", "c"], ["b"]]
    assert results[1] == ["b:1", "b:2", "b:3"]


def test_a_queue_of_jobs_keeps_at_most_max_live_running_and_starts_the_next_as_one_finishes():
    model = Recorder()
    results = Scheduler().run_all(
        [steps(model, "a", 1), steps(model, "b", 3), steps(model, "c", 2), steps(model, "d", 1)], max_live=2
    )
    # a leaves after the first forward and c joins the second; b leaves after the third, d joins it
    assert model.batches == [["a", "b"], ["b", "c"], ["b", "c"], ["d"]]
    assert results == [["a:1"], ["b:1", "b:2", "b:3"], ["c:2", "c:3"], ["d:4"]]
    with pytest.raises(ValueError, match="max_live"):
        Scheduler().run_all([steps(model, "e", 1)], max_live=0)


def test_budget_is_first_in_first_out_and_never_starves_a_big_segment():
    model = Recorder()
    scheduler = Scheduler(max_tokens_per_forward=4)
    scheduler.run_all([steps(model, "big", 1, tokens=10), steps(model, "x", 2, 2), steps(model, "y", 1, 2)])
    assert model.batches[0] == ["big"]  # the oldest goes alone although it exceeds the budget
    assert model.batches[1] == ["x", "y"]
    assert scheduler.stats.forwards == 3


def test_every_job_of_a_forward_sees_all_the_others_whatever_its_turn_to_resume():
    """Loops pass the scheduler's sessions() to their drafters, whose cost policies size a round by it:
    the job resumed first after a shared forward must count the jobs resumed after it (they are in no
    queue yet), and a finished job counts no more."""
    model = Recorder()
    seen: dict[str, list[int]] = {}
    scheduler = Scheduler()

    def session(name: str, rounds: int):
        def run() -> None:
            for _ in range(rounds):
                batched_call(model, Segment(name))
                seen.setdefault(name, []).append(scheduler.sessions())

        return run

    assert scheduler.sessions() == 1  # no job: whoever asks is alone
    scheduler.run_all([session("a", 2), session("b", 2), session("c", 3)])
    # a and b end after their second forward: each job counts only those not finished by its turn
    assert seen == {"a": [3, 3], "b": [3, 2], "c": [3, 1, 1]}
    scheduler.load_hint = lambda: 5  # a service that knows of more sessions than run jobs right now
    assert scheduler.sessions() == 5


def test_models_are_batched_separately():
    target, draft = Recorder(), Recorder()

    def session(name: str):
        return lambda: (batched_call(draft, Segment(name)), batched_call(target, Segment(name)))

    Scheduler().run_all([session("a"), session("b")])
    assert draft.batches == [["a", "b"]] and target.batches == [["a", "b"]]


def test_a_failed_forward_fails_its_jobs_only():
    model = Recorder()
    other = Recorder()
    scheduler = Scheduler()
    with pytest.raises(InvalidArgument):
        scheduler.run_all([steps(model, "boom", 1), steps(other, "fine", 2)])
    assert other.batches == [["fine"], ["fine"]]


def test_thread_serves_jobs_from_many_threads_and_joins_them_continuously():
    model = Recorder()
    thread = SchedulerThread("test-scheduler")
    try:
        futures = [thread.submit(steps(model, f"s{i}", 3)) for i in range(4)]
        assert [len(f.result(timeout=30)) for f in futures] == [3, 3, 3, 3]
        assert thread.run(lambda: threading.current_thread().name) == "test-scheduler"
    finally:
        thread.close()
    assert sum(len(b) for b in model.batches) == 12
    assert len(model.batches) < 12  # some forwards carried several sessions


def test_queue_bound_and_cancellation():
    release = threading.Event()
    model = Recorder()
    thread = SchedulerThread("test-bounded", max_queue=2)
    try:
        blocker = thread.submit(release.wait)  # occupies the model thread
        waiting = thread.submit(steps(model, "cancel-me", 50))
        with pytest.raises(ResourceExhausted):
            thread.submit(steps(model, "one-too-many", 1))
        thread.cancel(waiting)
        release.set()
        assert blocker.result(timeout=30)
        with pytest.raises(Cancelled):
            waiting.result(timeout=30)
        assert thread.submit(steps(model, "after", 1)).result(timeout=30) == [f"after:{len(model.batches)}"]
    finally:
        release.set()
        thread.close()
    assert all("cancel-me" not in b for b in model.batches)


def test_cancelling_mid_job_frees_it_at_its_next_forward():
    model = Recorder()
    thread = SchedulerThread("test-cancel")
    try:
        started = threading.Event()
        go = threading.Event()

        def long_job():
            batched_call(model, Segment("long"))
            started.set()
            go.wait(10)  # holds the model thread: the cancel lands before its next forward
            return [batched_call(model, Segment("long")) for _ in range(100)]

        future = thread.submit(long_job)
        started.wait(10)
        thread.cancel(future)
        go.set()
        with pytest.raises(Cancelled):
            future.result(timeout=30)
    finally:
        go.set()
        thread.close()
    assert sum(b.count("long") for b in model.batches) <= 2


def test_jobs_take_turns_with_wait_until():
    model = Recorder()
    holder = {"busy": False}
    order: list[str] = []

    def exclusive(name: str):
        def run():
            wait_until(lambda: not holder["busy"])
            holder["busy"] = True
            order.append(f"{name} in")
            batched_call(model, Segment(name))
            batched_call(model, Segment(name))
            order.append(f"{name} out")
            holder["busy"] = False

        return run

    Scheduler().run_all([exclusive("a"), exclusive("b"), steps(model, "free", 2)])
    assert order == ["a in", "a out", "b in", "b out"]
    assert model.batches[0] == ["a", "free"]  # others keep running while b waits


def test_a_wait_nobody_can_satisfy_is_an_error_not_a_hang():
    with pytest.raises(RuntimeError, match="waits"):
        Scheduler().run_all([lambda: wait_until(lambda: False)])


def test_thread_wide_inference_mode_survives_interleaved_jobs():
    """Jobs enter and leave torch.inference_mode() out of order; held by the thread, it stays on."""
    model = Recorder()
    with torch.inference_mode():
        buffer = torch.zeros(3)  # an inference tensor: in-place updates need inference mode

    def job(name: str):
        def run() -> None:
            with torch.inference_mode():
                batched_call(model, Segment(name))  # suspends inside the mode
            buffer.add_(1)

        return run

    errors: list[BaseException] = []

    def without_thread_context() -> None:  # on a thread of its own: the modes it scrambles die with it
        try:
            Scheduler().run_all([job("a"), job("b")])
        except RuntimeError as exc:
            errors.append(exc)

    thread = threading.Thread(target=without_thread_context)
    thread.start()
    thread.join()
    assert errors and "nference" in str(errors[0])  # a's exit turned the mode off under b
    Scheduler().run_all([job("a"), job("b")], thread_context=torch.inference_mode())
    assert not torch.is_inference_mode_enabled()
    assert buffer.tolist()[0] >= 2


def test_cheaper_models_go_first_so_the_expensive_batch_stays_whole():
    target, draft = Recorder(), Recorder()
    draft.priority = -1

    def drafting(name: str, steps_: int):
        return lambda: (
            [batched_call(draft, Segment(name)) for _ in range(steps_)],
            batched_call(target, Segment(name)),
        )

    Scheduler().run_all([drafting("a", 1), drafting("b", 3), drafting("c", 2)])
    assert target.batches == [["a", "b", "c"]]  # one target forward, after every draft step


@pytest.mark.parametrize("expected", [1, 2], ids=["alone", "one-more-expected"])
def test_a_forward_waits_for_the_jobs_expected_up_to_the_wait_limit(expected: int):
    """A service expects its recent sessions back: a forward waits (bounded) for a late one to join."""
    model = Recorder()
    thread = SchedulerThread("test-wait", max_wait_seconds=2.0)
    thread.expected_jobs = lambda: expected
    try:
        first = thread.submit(steps(model, "a", 1))
        threading.Event().wait(0.3)  # the second session's request is still on its way
        second = thread.submit(steps(model, "b", 1))
        first.result(timeout=5), second.result(timeout=5)
    finally:
        thread.close()
    assert model.batches == ([["a"], ["b"]] if expected == 1 else [["a", "b"]])


def test_a_forward_leaves_without_a_job_that_does_not_come_in_time():
    model = Recorder()
    thread = SchedulerThread("test-wait-limit", max_wait_seconds=0.05)
    thread.expected_jobs = lambda: 5  # four never come
    try:
        thread.submit(steps(model, "a", 2)).result(timeout=5)
    finally:
        thread.close()
    assert model.batches == [["a"], ["a"]]


def test_time_inside_each_models_forwards_is_counted_apart():
    class Slow(Recorder):
        def forward_batch(self, segments: Sequence[Segment]) -> list[str]:
            threading.Event().wait(0.05)
            return super().forward_batch(segments)

    target, draft = Slow(), Recorder()
    target.label, draft.label = "target", "draft"
    scheduler = Scheduler()
    scheduler.run_all([steps(target, "a", 2), steps(draft, "b", 1)])
    seconds = scheduler.stats.seconds_per_model
    assert set(seconds) == {"target", "draft"}
    assert seconds["target"] >= 0.1 > seconds["draft"]  # two slow forwards, one quick one
