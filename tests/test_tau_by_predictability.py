"""research.tau_by_predictability: sampled and greedy τ of one drafter, grouped by the answers' NLL."""

import pytest

from research.tau_by_predictability import by_predictability


def record(method, tokens, forwards, nll_per_token):
    return {"method": method, "tokens": tokens, "forwards": forwards, "nll": nll_per_token * tokens}


def test_turns_are_grouped_by_nll_per_token_and_tau_pools_tokens_over_forwards():
    records = [
        record("hf_bpd", 100, 50, 0.1),
        record("hf_bpd", 60, 40, 0.1),
        record("hf_bpd", 30, 30, 2.0),
        record("hf_bpd_greedy", 120, 30, 0.2),
        record("hf_bpd_greedy", 0, 1, 0.0),  # an empty answer has no NLL per token: left out
        record("sample", 128, 128, 0.1),
    ]
    out = by_predictability(records)
    low, top = out["buckets"][0], out["buckets"][-1]
    assert low["nll_range"] == [0.0, 0.25] and top["nll_range"] == [1.5, None]
    assert low["hf_bpd"]["turns"] == 2 and low["hf_bpd"]["tau"] == pytest.approx(160 / 90)
    assert low["hf_bpd_greedy"]["tau"] == 4.0 and top["hf_bpd"]["tau"] == 1.0 and top["hf_bpd_greedy"]["turns"] == 0
    assert out["overall"]["hf_bpd"]["tau"] == pytest.approx(190 / 120)
    assert out["overall"]["hf_bpd"]["nll_per_token"] == pytest.approx((10 + 6 + 60) / 190)
    assert sum(b["hf_bpd"]["turns"] for b in out["buckets"]) == 3
    # matched: only the lowest group holds both; greedy would spend 160 / 4 forwards on its 160 sampled tokens
    assert out["matched"]["sampled_tokens_covered"] == 160 and out["matched"]["greedy_tau_at_sampled_mix"] == 4.0
    assert out["matched"]["sampled_tau"] == pytest.approx(160 / 90)
    assert out["matched"]["ratio"] == pytest.approx(40 / 90)


def test_a_journal_without_the_greedy_twin_is_refused():
    with pytest.raises(SystemExit, match="hf_bpd_greedy"):
        by_predictability([record("hf_bpd", 10, 5, 0.5)])
