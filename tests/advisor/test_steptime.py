"""The advisor's clock: enough samples for a median, samples stalled by other processes set aside, and a result
that says when too few were clean."""

import itertools
import sys
import time

import pytest
import torch

from workbench.advisor import steptime
from workbench.advisor.steptime import STALL, StepTime, pooled, runqueue_wait, time_parts, time_step, time_steps

CPU = torch.device("cpu")


def test_a_step_longer_than_min_run_time_is_still_timed_five_times():
    calls = []

    def slow():
        calls.append(1)
        time.sleep(0.02)

    measured = time_step(slow, min_run_time=0.01, device=CPU)
    assert measured.samples >= 5 and measured.calls == len(calls) >= 6  # the warm-up, then one call per sample
    assert measured.seconds >= 0.02


def test_short_steps_are_timed_in_blocks_of_calls():
    calls = []
    measured = time_step(lambda: calls.append(1), min_run_time=0.01, device=CPU)
    assert measured.calls == len(calls) and measured.calls > 5 * measured.samples


def test_steps_are_timed_on_the_callers_threads():
    saved = torch.get_num_threads()
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            seen = []
            time_step(lambda seen=seen: seen.append(torch.get_num_threads()), min_run_time=0.01, device=CPU)
            assert set(seen) == {threads}
    finally:
        torch.set_num_threads(saved)


def _stalling(monkeypatch, stalled_samples):
    """runqueue_wait as if the threads waited 10x a sample's wall time in the given samples (0-based)."""
    clock = itertools.count()
    state = {"sample": -1, "waited": 0.0}

    def fake():
        if next(clock) % 2 == 0:  # read before a sample
            state["sample"] += 1
        elif state["sample"] in stalled_samples:
            state["waited"] += 10.0
        return state["waited"]
    monkeypatch.setattr(steptime, "runqueue_wait", fake)


def test_samples_whose_threads_waited_for_a_cpu_are_set_aside(monkeypatch):
    _stalling(monkeypatch, {0, 2})
    # a warm-up longer than min_run_time / 5: one call per sample
    durations = iter([0.01] + [0.5 if i in (0, 2) else 0.001 for i in range(20)])

    def step():
        time.sleep(next(durations))

    measured = time_step(step, min_run_time=0.001, device=CPU)
    assert measured.calls == 8 and measured.stalled == 2 and measured.samples == 7 and measured.reliable
    assert measured.seconds < 0.1  # the median of the five clean samples, not the stalled 0.5 s


def test_a_machine_too_busy_to_time_is_said_so(monkeypatch):
    _stalling(monkeypatch, set(range(100)))
    measured = time_step(lambda: None, min_run_time=0.001, device=CPU, most=9)
    assert measured.samples == 9 and measured.stalled == 9 and not measured.reliable
    assert not StepTime(1.0, 10, 5, 3).reliable and StepTime(1.0, 10, 5, 2).reliable
    assert 0 < STALL < 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="run-queue waits are read from Linux's schedstat")
def test_the_run_queue_wait_is_read_on_linux():
    first = runqueue_wait()
    assert first is not None and first >= 0
    assert runqueue_wait() >= first


def test_parts_of_stalled_passes_are_set_aside_and_identical_parts_pooled(monkeypatch):
    _stalling(monkeypatch, {1, 2})  # the warm-up reads no wait; passes 1 and 2 of the timed ones stall
    results = iter([[9.0, 9.0], [1.0, 2.0], [50.0, 50.0], [60.0, 60.0], [1.2, 2.2], [0.8, 1.8], [1.0, 2.0],
                    [1.1, 2.1]])
    parts, reliable = time_parts(lambda: next(results), passes=5)
    assert reliable and parts == [1.0, 2.0]  # the five clean passes' medians; the warm-up and stalls left out
    assert pooled([1.0, 3.0, 10.0, 2.0], ["block", "block", "head", "block"]) == [2.0, 2.0, 10.0, 2.0]


def test_a_part_of_the_step_is_read_off_the_same_calls():
    clock = []

    def step():
        start = time.perf_counter()
        time.sleep(0.004)  # the part: a forward
        clock.append(time.perf_counter() - start)
        time.sleep(0.008)

    def part() -> float:
        spent = sum(clock)
        clock.clear()
        return spent

    measured = time_step(step, min_run_time=0.01, device=CPU, part=part)
    assert 0.004 <= measured.part_seconds < measured.seconds
    assert measured.seconds >= 0.012
    assert time_step(step, min_run_time=0.01, device=CPU).part_seconds != time_step(  # no part: NaN
        step, min_run_time=0.01, device=CPU).part_seconds


def test_steps_timed_together_take_turns_and_a_stalled_round_is_set_aside_whole(monkeypatch):
    order = []

    def step(name, seconds):
        def run():
            order.append(name)
            time.sleep(seconds)
        return run

    short, long = time_steps([step("a", 0.002), step("b", 0.006)], min_run_time=0.001, device=CPU)
    assert order[:2] == ["a", "b"]  # the warm-ups, then rounds of one sample of each, the order rotated
    assert order[2:8] == ["a", "b", "b", "a", "a", "b"]
    assert short.samples == long.samples >= 5 and 0.002 <= short.seconds < long.seconds
    counts = {"a": 0, "b": 0}
    quick = time_steps([lambda: counts.__setitem__("a", counts["a"] + 1), lambda: None], min_run_time=0.01,
                       device=CPU)
    assert quick[0].calls == counts["a"] > quick[0].samples * 2  # blocks of calls, each after one untimed call
    _stalling(monkeypatch, {1})  # the second sample timed: round 0's "b"; its "a" is set aside with it
    durations = iter([0.001, 0.001] + [0.5 if i in (0, 1) else 0.001 for i in range(40)])
    first, _ = time_steps([lambda: time.sleep(next(durations))] * 2, min_run_time=0.001, device=CPU)
    assert first.stalled == 1 and first.seconds < 0.1
