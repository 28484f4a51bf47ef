"""`training.ship`: replaces the packaged heads and their records, keeps the rescorers shipped beside them."""

from __future__ import annotations

import json

import torch
from conftest import random_heads, tiny_distilled, tiny_model

import hf_bpd
from training import ship
from training.distill import data_digest, load_distilled


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
    assert ship.main([*argv, "--to", str(dest)]) == 0
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
