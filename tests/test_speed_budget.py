"""research.speed_budget: where a drafting method's time goes against the fastest plain method of a run."""

import pytest

from research.speed_budget import budget


def plain(method, turn, seconds, tokens=100):
    return {"method": method, "row": turn, "turn": 0, "tokens": tokens, "forwards": tokens, "seconds": seconds}


def drafted(turn, seconds, steps, phases, tokens=100):
    record = plain("hf_bpd", turn, seconds, tokens)
    return {**record, "forwards": steps + 1, "steps": steps, "step_seconds": phases}


def test_phases_shares_and_bounds_are_read_against_the_fastest_plain_method():
    phases = {"heads": 0.5, "verify_forward": 3.0, "accept": 0.25, "cache_compaction": 0.25}
    records = [
        plain("greedy", 0, 10.0),
        plain("greedy_compiled", 0, 8.0),
        drafted(0, 5.0, 40, phases),
        plain("greedy", 1, 10.0),
        plain("greedy_compiled", 1, 8.0),
        drafted(1, 5.0, 40, phases),
        plain("greedy", 2, 10.0),  # a turn the other methods did not finish: left out
    ]
    out = budget(records, ["greedy", "greedy_compiled", "hf_bpd"])
    assert out["turns"] == 2 and out["fastest_plain"] == "greedy_compiled"
    assert out["plain_ms_per_token"] == pytest.approx(80.0)
    m = out["methods"]["hf_bpd"]
    assert list(out["methods"]) == ["hf_bpd"]  # plain methods have no budget
    assert m["speedup"] == pytest.approx(16.0 / 10.0) and m["tau"] == pytest.approx(200 / 82)
    assert m["ms_per_step"]["verify_forward"] == pytest.approx(75.0) and m["ms_per_step"]["rescore"] == 0.0
    assert m["verify_in_plain_tokens"] == pytest.approx(75.0 / 80.0)
    assert m["tau_over_verify_ratio"] == pytest.approx((200 / 80) / (75.0 / 80.0))
    # 10 s in all: 8 s in the step phases, 2 s of prefill and loop (1 s a turn)
    assert m["share"]["prefill_and_loop"] == pytest.approx(0.2) and m["share"]["heads"] == pytest.approx(0.1)
    assert m["prefill_and_loop_ms_per_turn"] == pytest.approx(1000.0)
    assert sum(m["share"].values()) == pytest.approx(1.0)
    assert m["speedup_without"]["heads"] == pytest.approx(16.0 / 9.0)
    assert "verify_forward" not in m["speedup_without"]
