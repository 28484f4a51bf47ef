"""research/gpu/captured_step.py, the captured step's GPU measurement, and research/gpu/tree_rounding.py, where a
tree's logits part from the one-token steps', in their CPU mode (`--dry-run`: tiny models, a few tokens): the
whole script path runs here, and every JSON line it writes has the fields the GPU run's rows are read by.
Needs no GPU; measures nothing."""

from __future__ import annotations

import json

import torch

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


def test_first_divergence_names_the_first_module_whose_row_differs():
    from research.gpu.tree_rounding import first_divergence

    a = torch.arange(6.0).reshape(1, 3, 2)
    b = a * 10
    chain = [("model.layers.0.q_proj", a), ("model.layers.0.mlp", b), ("lm_head", b + 1)]

    def step(i, q=None, mlp=None):
        return [
            ("model.layers.0.q_proj", a[:, i : i + 1] if q is None else q),
            ("model.layers.0.mlp", b[:, i : i + 1] if mlp is None else mlp),
            ("lm_head", b[:, i : i + 1] + 1),
        ]

    steps = [step(0), step(1, mlp=torch.zeros(1, 1, 2)), step(2, q=torch.ones(1, 1, 2))]
    assert first_divergence(chain, steps) == [None, "model.layers.0.mlp", "model.layers.0.q_proj"]


def test_the_rounding_script_traces_every_differing_row_to_a_module(tmp_path):
    from research.gpu.tree_rounding import main as rounding

    out = tmp_path / "rounding.jsonl"
    assert rounding(["--dry-run", "--shapes", "tiny:float32", "tiny:bfloat16", "--output", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {(r["dtype"], r["setting"]) for r in rows} == {
        (d, s)
        for d in ("float32", "bfloat16")
        for s in ("default", "repeat", "no_reduced_bf16", "cublaslt", "rowwise", "math_sdpa")
    }
    for r in rows:
        if r["setting"] in ("no_reduced_bf16", "cublaslt"):
            assert r["skipped"] == "a CUDA setting"
            continue
        assert 0 <= r["rows_equal"] <= r["argmax_equal"] <= r["rows"] == r["chain"]
        if r["setting"] == "repeat":  # the same one-token steps twice: a CPU is deterministic
            assert r["rows_equal"] == r["rows"] and r["max_abs_diff"] == 0
            continue
        # every row whose logits differ is traced to a first module that differs (a row whose logits agree may
        # still carry an earlier difference that rounded away)
        assert r["rows"] >= sum(r["first_divergence"].values()) >= r["rows"] - r["rows_equal"]
        assert set(r["ops"]) >= {"final norm"} and all(0 <= v <= r["rows"] for v in r["ops"].values())
