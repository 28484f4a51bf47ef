"""`DecodingStats`: τ counts the prefill as a forward, a step records its tokens and plain steps, the step
clock books its phases' times and host waits, and per-step figures divide by the steps taken."""

from __future__ import annotations

import pytest
import torch

from hf_bpd.decode.call import StepClock
from hf_bpd.decode.stats import DecodingStats


def test_block_efficiency_counts_the_prefill_as_a_forward():
    stats = DecodingStats(steps=3, new_tokens=8)
    assert stats.forwards == 4 and stats.block_efficiency == 2.0
    assert DecodingStats().block_efficiency == 0.0  # nothing decoded: no division by the lone prefill


def test_a_step_records_its_tokens_and_whether_it_drafted_and_the_clock_books_its_phases():
    stats = DecodingStats()
    stats.record_step(drafted=True, new=5, nodes=12)
    stats.record_step(drafted=False, new=2, nodes=2)
    assert (stats.steps, stats.plain_steps, stats.new_tokens) == (2, 1, 7)
    assert stats.accepted_lengths == [5, 2] and stats.tree_sizes == [12, 2] and stats.mean_accepted == 3.5

    clock = StepClock(stats, torch.device("cpu"), profile=False, count_syncs=True)
    readings = iter([1.0, 1.25, 1.25, 1.375, 1.375, 1.5, 2.25])  # (start, end) of each phase, then the step's end
    clock.now = lambda: next(readings)
    for name in ("verify", "accept", "cache"):
        with clock.phase(name):
            torch.ones(1).item()  # one host wait in each phase
    clock.step_start = 0.25
    assert clock.step_seconds() == pytest.approx(2.0) and clock.last == pytest.approx(0.125)
    clock.close()
    per_step = stats.time_per_step()  # over the two steps recorded above
    assert per_step["verify_forward"] == pytest.approx(0.125)
    assert per_step["accept"] == pytest.approx(0.0625) and per_step["cache_compaction"] == pytest.approx(0.0625)
    assert stats.host_syncs == {"verify": 1, "accept": 1, "cache": 1}


def test_host_syncs_per_step_keep_the_prefill_per_call():
    stats = DecodingStats(steps=4, host_syncs={"prefill": 3, "accept": 4, "draft": 2})
    assert stats.host_syncs_per_step() == {"prefill": 3, "accept": 1.0, "draft": 0.5}
