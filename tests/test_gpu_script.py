"""research/gpu/captured_step.py, the captured step's GPU measurement, in its CPU mode (`--dry-run`: tiny
models, a few tokens): the whole script path runs here, and every JSON line it writes has the fields the
GPU run's rows are read by. Needs no GPU; measures nothing."""

from __future__ import annotations

import json

from research.gpu.captured_step import main

COMMON = {"part", "dtype", "device", "torch", "transformers", "tiny", "elapsed_s"}


def test_captured_step_script_runs_its_whole_path_on_a_cpu_and_writes_one_line_per_configuration(tmp_path):
    out = tmp_path / "rows.jsonl"
    assert main(["--dry-run", "--output", str(out), "--rows", "2"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(set(r) >= COMMON and r["tiny"] and r["device"] == "cpu" and "skipped" not in r for r in rows)
    by = {(r["part"], r["method"]): r for r in rows}
    assert set(by) == {
        ("random", "greedy_static"),
        ("random", "captured"),
        ("real", "greedy_static"),
        ("real", "hf_bpd_static"),
        ("real", "captured"),
        ("bf16", "greedy_static"),
        ("bf16", "captured"),
    }
    plain, step = by[("random", "greedy_static")], by[("random", "captured")]
    assert {"shape", "ms_per_token", "tokens_per_s", "warmup_s"} <= set(plain)
    assert {"tree_tokens", "ms_per_token", "ms_per_step", "tau", "tokens_per_s", "step_over_plain_token"} <= set(step)
    assert step["tau"] >= 1
    for part in ("real", "bf16"):
        assert by[(part, "greedy_static")]["new_tokens"] > 0
        for method in ("hf_bpd_static", "captured") if part == "real" else ("captured",):
            r = by[(part, method)]
            assert {"identical", "of", "tau", "tokens_per_s", "seconds", "new_tokens", "rows"} <= set(r)
            assert r["of"] == r["rows"] == 2 and r["tau"] >= 1
    # float32: the tree decodings give plain static-cache greedy's tokens
    assert by[("real", "captured")]["identical"] == 2 and by[("real", "hf_bpd_static")]["identical"] == 2


def test_the_profile_part_names_where_each_calls_time_goes(tmp_path):
    out = tmp_path / "rows.jsonl"
    assert (
        main(["--dry-run", "--parts", "profile", "--trees", "4", "8", "--profile-top", "5", "--output", str(out)]) == 0
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["part"], r["method"], r["tree_tokens"]) for r in rows] == [
        ("profile", "greedy_static", 1),
        ("profile", "captured", 4),
        ("profile", "captured", 8),
    ]
    for r in rows:
        assert set(r) >= COMMON | {"steps", "wall_ms_per_step", "device_busy_ms_per_step", "top"}
        assert r["device_busy_ms_per_step"] is None  # a CPU has no device timeline
        assert len(r["top"]) == 5 and all(op["calls"] > 0 and op["own_ms_per_step"] >= 0 for op in r["top"])
        assert 1 <= r["steps"] <= r["new_tokens"]
    # a plain call's one-token forwards and the captured calls' trees: a tree step emits at least one token
    assert rows[0]["steps"] == rows[0]["new_tokens"]
    assert any(op["name"] == "aten::mm" for op in rows[0]["top"])
