"""`DecodingStats`: τ counts the prefill as a forward, a batch step records its phases and plain steps, and
per-step figures divide by the steps taken."""

from __future__ import annotations

import pytest

from hf_bpd.stats import DecodingStats


def test_block_efficiency_counts_the_prefill_as_a_forward():
    stats = DecodingStats(steps=3, new_tokens=8)
    assert stats.forwards == 4 and stats.block_efficiency == 2.0
    assert DecodingStats().block_efficiency == 0.0  # nothing decoded: no division by the lone prefill


def test_a_batch_step_records_its_phases_tokens_and_whether_it_drafted():
    stats = DecodingStats()
    stats.record_batch_step((1.0, 1.5, 1.75, 2.0), drafted=True, new=5, nodes=12)
    stats.record_batch_step((3.0, 3.25, 3.5, 3.5), drafted=False, new=2, nodes=2)
    assert (stats.steps, stats.plain_steps, stats.new_tokens) == (2, 1, 7)
    assert stats.accepted_lengths == [5, 2] and stats.tree_sizes == [12, 2] and stats.mean_accepted == 3.5
    per_step = stats.time_per_step()
    assert per_step["verify_forward"] == pytest.approx(0.375)
    assert per_step["accept"] == pytest.approx(0.25) and per_step["cache_compaction"] == pytest.approx(0.125)


def test_host_syncs_per_step_keep_the_prefill_per_call():
    stats = DecodingStats(steps=4, host_syncs={"prefill": 3, "accept": 4, "draft": 2})
    assert stats.host_syncs_per_step() == {"prefill": 3, "accept": 1.0, "draft": 0.5}
