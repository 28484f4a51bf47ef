"""`hf-bpd cost-model`: forward and drafting times on random Llama-shaped models, projected with τ(n)."""

import json

import pytest

from hf_bpd import cli
from hf_bpd.tools.cost_model import SHAPES, measure_plain_generate, projection, random_llama, read_replay_taus


def test_projection_is_tau_times_greedy_cost_over_step_cost():
    forward = {1: 0.05, 8: 0.06, 16: 0.08}
    draft = {1: 0.001, 8: 0.004, 16: 0.006}
    rows = projection(forward, draft, {8: 2.4, 16: 2.6})
    by_n = {r["tree_tokens"]: r for r in rows}
    assert "speedup" not in by_n[1] and by_n[1]["forward_ratio"] == 1.0
    assert by_n[8]["speedup"] == pytest.approx(2.4 * 0.05 / 0.064)
    assert by_n[8]["limit"] == pytest.approx(2.4 * 0.05 / 0.06)
    assert by_n[16]["draft_ratio"] == pytest.approx(0.12)


def test_random_llama_has_the_named_shape():
    model = random_llama("tiny")
    hidden, layers, heads, kv_heads, mlp, vocab = SHAPES["tiny"]
    assert model.config.hidden_size == hidden and model.config.num_hidden_layers == layers
    assert model.get_output_embeddings().weight.shape == (vocab, hidden)
    assert all(p.isfinite().all() for p in model.parameters())
    with pytest.raises(ValueError, match="unknown shape"):
        random_llama("13b")


def test_cost_model_command_projects_with_replayed_taus(tmp_path):
    replay = tmp_path / "replay.json"
    limits = [{"drafter": "k10 n2", "tree_tokens": 2, "tau": 1.5}, {"drafter": "k10 n4", "tree_tokens": 4, "tau": 1.9}]
    replay.write_text(json.dumps({"limits": limits}))
    assert read_replay_taus(replay) == {2: 1.5, 4: 1.9}
    out = tmp_path / "cost.json"
    args = ["cost-model", "--shapes", "tiny", "--tree-sizes", "2", "4", "--repeats", "1", "--context", "16"]
    assert cli.main([*args, "--replay", str(replay), "--output", str(out)]) == 0
    rows = json.loads(out.read_text())["shapes"]["tiny"]
    assert [r["tree_tokens"] for r in rows] == [1, 2, 4]  # t(1), the greedy baseline, is always timed
    for r in rows[1:]:
        assert r["forward_s"] > 0 and r["draft_s"] > 0
        assert r["speedup"] == pytest.approx(r["tau"] * rows[0]["forward_s"] / (r["forward_s"] + r["draft_s"]))
    assert "projected speedup" in out.with_suffix(".md").read_text()


def test_replay_taus_from_drafter_names(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(
        json.dumps({"drafters": {"k10 n8": {"overall": {"tau": 2.5}}, "k10 n16": {"overall": {"tau": 2.8}}}})
    )
    assert read_replay_taus(path) == {8: 2.5, 16: 2.8}


def test_projection_over_the_fastest_plain_generate_divides_by_its_per_token_time():
    rows = projection({1: 0.02, 4: 0.024}, {1: 0.0, 4: 0.001}, {4: 2.0}, fastest_plain=0.004)
    by_n = {r["tree_tokens"]: r for r in rows}
    assert by_n[4]["speedup_fastest"] == pytest.approx(2.0 * 0.004 / 0.025)
    assert by_n[4]["speedup"] == pytest.approx(2.0 * 0.02 / 0.025)  # over the bare one-token forward
    assert "speedup_fastest" not in projection({1: 0.02, 4: 0.024}, {}, {4: 2.0})[1]


def test_plain_generate_is_timed_per_new_token_for_each_cache_and_a_failing_cache_is_reported(monkeypatch):
    model = random_llama("tiny")
    calls = []
    real_generate = model.generate

    def generate(*args, **kwargs):
        calls.append((kwargs["cache_implementation"], kwargs["max_new_tokens"], kwargs["min_new_tokens"]))
        if kwargs["cache_implementation"] == "static":
            raise RuntimeError("no static cache here")
        return real_generate(*args, **kwargs)

    monkeypatch.setattr(model, "generate", generate)
    errors = {}
    plain = measure_plain_generate(model, context=8, new_tokens=4, repeats=1, errors=errors)
    assert set(plain) == {"dynamic"} and plain["dynamic"] > 0
    assert errors == {"static": "RuntimeError: no static cache here"}
    # warm-up of both lengths, then one timed pair; each length decodes exactly that many tokens
    assert calls[:4] == [("dynamic", 1, 1), ("dynamic", 5, 5), ("dynamic", 5, 5), ("dynamic", 1, 1)]
