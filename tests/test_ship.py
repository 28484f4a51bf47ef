"""`hf_bpd.training.ship`: replaces the packaged heads and their records, keeps the rescorers shipped beside them."""

from __future__ import annotations

import json

import torch
from conftest import random_heads, tiny_distilled, tiny_model

import hf_bpd
from hf_bpd.training import ship
from hf_bpd.training.distill import data_digest, load_distilled


def test_ship_replaces_heads_and_keeps_rescorers(tmp_path):
    model = tiny_model()
    trained = tmp_path / "run"
    heads = random_heads(model, num_heads=4, use_next_token=True)
    heads.save_pretrained(trained)
    (trained / "training_log.json").write_text(json.dumps({"epochs": []}))
    for name, rows in (("distill", 3), ("distill_more", 2)):
        tiny_distilled(model, n=rows).save_to_disk(str(tmp_path / name / "dataset"))
        (tmp_path / name / "manifest.json").write_text(json.dumps({"num_prompts": 8, "prompts": f"{name}.jsonl"}))
    (tmp_path / "drafter.json").write_text(json.dumps({"num_heads": 2, "top_k": 5, "max_tree_tokens": "auto"}))
    dest = tmp_path / "assets"
    (dest / "ngram").mkdir(parents=True)
    (dest / "ngram" / "ngram.json").write_text("{}")
    (dest / "rescorers.json").write_text("{}")
    (dest / "heads").mkdir()
    (dest / "heads" / "stale.bin").write_text("old heads")
    argv = [
        "--heads",
        str(trained),
        "--distilled",
        str(tmp_path / "distill"),
        str(tmp_path / "distill_more"),
        "--drafter",
        str(tmp_path / "drafter.json"),
    ]
    bench = {
        "environment": {"date": "2026-11-25", "device": "cpu"},
        "args": {"max_new_tokens": 64},
        "rows": 3,
        "methods": {
            "greedy": {"overall": {"tau": 1.0}, "categories": {}},
            "hf_bpd": {
                "overall": {"tau": 2.5, "speedup": 1.4, "identical": True, "turns": 3, "tokens_per_s": 9.0},
                "categories": {"qa": {"tau": 2.5, "speedup": 1.4, "identical": True, "turns": 3}},
            },
        },
    }
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    assert ship.main([*argv, "--to", str(dest), "--bench", str(tmp_path / "bench.json")]) == 0
    # the card: README.md beside heads that are no packaged model's (model_cards/<name>.md for those)
    card = (dest / "README.md").read_text()
    assert "| qa | 2.50 | 1.40× | True |" in card and "max_new_tokens=64, 3 prompts." in card
    assert "tokens_per_s" not in (dest / "bench.json").read_text()  # what the card shows, no more
    assert (dest / "ngram" / "ngram.json").is_file() and (dest / "rescorers.json").is_file()
    assert not (dest / "heads" / "stale.bin").exists()
    assert json.loads((dest / "drafter.json").read_text()) == {"top_k": 5, "max_tree_tokens": "auto"}
    manifest = json.loads((dest / "manifest.json").read_text())  # the rows each run holds, not its last --limit
    assert [(r["prompts"], r["num_samples"]) for r in manifest["runs"]] == [
        ("distill.jsonl", 3),
        ("distill_more.jsonl", 2),
    ]
    for run, name in zip(manifest["runs"], ("distill", "distill_more")):  # and what they hold, to check reruns
        held = data_digest(load_distilled(tmp_path / name))
        assert {k: run[k] for k in held} == held and len(run["sha256"]) == 64
    shipped = hf_bpd.BlockDraftHeads.from_pretrained(dest / "heads").bind(model)
    assert shipped.num_heads == 2 and shipped.config.use_next_token
    x, tokens = torch.randn(3, model.config.hidden_size), torch.tensor([1, 2, 3])
    torch.testing.assert_close(shipped(x, tokens), heads(x, tokens)[:, :2])
    # with --corpus the distilled answers travel as the drafter's retrieval corpus; shipping again without drops it
    assert ship.main([*argv, "--to", str(dest), "--corpus", str(tmp_path / "distill")]) == 0
    assert json.loads((dest / "drafter.json").read_text())["corpus"] == "corpus.npz"
    answers = load_distilled(tmp_path / "distill")["response_ids"]
    assert hf_bpd.CorpusIndex.load(dest / "corpus.npz").tokens.tolist() == [t for a in answers for t in (*a, -1)]
    assert ship.main([*argv, "--to", str(dest)]) == 0
    assert not (dest / "corpus.npz").exists() and "corpus" not in json.loads((dest / "drafter.json").read_text())


def one_run_argv(tmp_path, model, trained, settings: dict) -> list[str]:
    """ship's arguments for the module saved in `trained`, one distilled run of 3 answers and `settings`."""
    tiny_distilled(model, n=3).save_to_disk(str(tmp_path / "distill" / "dataset"))
    (tmp_path / "distill" / "manifest.json").write_text(json.dumps({"num_prompts": 3, "prompts": "p.jsonl"}))
    (tmp_path / "drafter.json").write_text(json.dumps(settings))
    return [
        "--heads",
        str(trained),
        "--distilled",
        str(tmp_path / "distill"),
        "--drafter",
        str(tmp_path / "drafter.json"),
    ]


def test_ship_keeps_the_earlier_heads_runs_and_records_the_pointer_stage(tmp_path):
    from hf_bpd.card import data_recipe, render_card

    model = tiny_model()
    trained = tmp_path / "run"
    heads = random_heads(model, num_heads=2, token_input="previous").with_context_copy(8)
    heads.save_pretrained(trained)
    (trained / "training_log.json").write_text(json.dumps({"epochs": []}))
    argv = one_run_argv(tmp_path, model, trained, {"top_k": 5})
    earlier = {"runs": [{"prompts": "a.jsonl", "num_samples": 7}, {"prompts": "b.jsonl", "num_samples": 5}]}
    (tmp_path / "earlier.json").write_text(json.dumps(earlier))
    dest = tmp_path / "assets"
    argv += ["--earlier-manifest", str(tmp_path / "earlier.json"), "--stage", "context-copy pointer", "--to", str(dest)]
    (dest).mkdir()
    (dest / "bench.json").write_text("{}")  # measured with the heads shipped before: no longer theirs
    assert ship.main([*argv, "--card", str(tmp_path / "cards" / "mine.md")]) == 0
    assert not (dest / "bench.json").exists() and not (dest / "README.md").exists()
    card = (tmp_path / "cards" / "mine.md").read_text()
    assert "- context-copy pointer: Greedy answers" in card and "_not measured_" in card
    manifest = json.loads((dest / "manifest.json").read_text())
    assert [(r["prompts"], r["num_samples"], r.get("stage")) for r in manifest["runs"]] == [
        ("a.jsonl", 7, None),
        ("b.jsonl", 5, None),
        ("p.jsonl", 3, "context-copy pointer"),
    ]
    recipe = data_recipe(manifest)
    assert recipe.count("- ") == 3 and "- context-copy pointer: Greedy answers of the base model itself to 3" in recipe
    shipped = hf_bpd.BlockDraftHeads.from_pretrained(dest / "heads").bind(model)
    assert shipped.config.copy_dim == 8
    assert "8-wide attention" in render_card(shipped, manifest=manifest)


def test_ship_takes_an_eagle_layer_and_the_packaged_loader_drafts_with_it(tmp_path, monkeypatch):
    from hf_bpd.drafting.eagle import EagleDraftLayer
    from hf_bpd.io import packaged
    from tests.test_eagle_layer import random_layer, sequence

    model = tiny_model()
    trained = tmp_path / "run"
    layer = random_layer(model)
    layer.save_pretrained(trained)
    log = {"steps": 100, "epochs_done": 2.0, "args": {"samples": 200, "depth": 3}, "loss_by_50_steps": [9.0, 4.5]}
    (trained / "training_log.json").write_text(json.dumps(log))
    argv = one_run_argv(tmp_path, model, trained, {"top_k": 4, "max_tree_tokens": 8, "context_lookup": 10})
    dest = tmp_path / "assets"
    assert ship.main([*argv, "--to", str(dest)]) == 0
    card = (dest / "README.md").read_text()  # the layer's own card: what it reads, how it was trained
    assert "# EAGLE draft layer" in card and "## Per-head accuracy" not in card
    assert "`hf-bpd train-eagle`: 100 steps (2.0 epochs) over 200 distilled answers" in card
    assert "Loss (mean of 50 steps): 9.00 at the start, 4.50 at the end." in card
    # the packaged loader reads the module the config names, with the shipped settings
    monkeypatch.setattr(packaged, "packaged_heads_dir", lambda model=None, kind="default": dest / "heads")
    drafter = packaged.load_packaged_drafter()
    assert isinstance(drafter.heads, EagleDraftLayer)
    assert (drafter.top_k, drafter.max_tree_tokens, drafter.context_lookup) == (4, 8, 10)
    shipped = drafter.heads.bind(model)
    tokens, features = sequence(8, model, 2)
    with torch.no_grad():
        for a, b in zip(layer.unroll(features[None], tokens[None], 3), shipped.unroll(features[None], tokens[None], 3)):
            torch.testing.assert_close(a, b)
