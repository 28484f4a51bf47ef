"""Model card and Hub folder, offline: the card renders with real numbers and the uploaded folder loads."""

from __future__ import annotations

import pytest
import torch
from conftest import random_heads, tiny_model

import hf_bpd
from hf_bpd.card import render_card, save_hub_folder

LOG = {"epochs": [{"epoch": 0, "top1": [0.61, 0.33], "top5": [0.8, 0.55], "oracle_top5": 1.37, "positions": 900}]}
BENCH = {
    "environment": {"date": "2026-11-22", "device": "cpu"},
    "args": {"max_new_tokens": 128},
    "rows": 240,
    "methods": {
        "hf_bpd": {
            "overall": {"tau": 2.41, "speedup": 1.3, "identical": True},
            "categories": {"qa": {"tau": 2.2, "speedup": 1.2, "identical": True}},
        }
    },
}
MANIFEST = {
    "num_prompts": 1200,
    "prompts": "../shared/data/train_prompts.jsonl",
    "seed": 0,
    "max_prompt_tokens": 256,
    "max_new_tokens": 128,
}


def test_card_renders_real_numbers():
    heads = random_heads(tiny_model("llama"), num_heads=2)
    card = render_card(heads, "me/heads", training_log=LOG, bench=BENCH, manifest=MANIFEST, top_k=7)
    assert "| 1 | 0.610 | 0.800 |" in card and "| 2 | 0.330 | 0.550 |" in card
    assert "| qa | 2.20 | 1.20× | True |" in card and "2.41" in card
    assert "1200 prompts" in card and 'from_pretrained("me/heads", top_k=7' in card
    assert "{" not in card.split("```python")[0]  # no unrendered placeholder before the code block
    assert "the embedding of" not in card  # plain heads read the hidden state only
    previous = render_card(random_heads(tiny_model("llama"), num_heads=2, token_input="previous"), "me/heads")
    assert "the drafted token at depth i-1" in previous


def test_card_lists_every_distilled_run():
    heads = random_heads(tiny_model("llama"), num_heads=2)
    runs = {
        "runs": [{**MANIFEST, "num_samples": 4160}, {**MANIFEST, "prompts": "de.jsonl", "num_samples": 9, "offset": 5}]
    }
    card = render_card(heads, "me/heads", manifest=runs)
    assert "- Greedy answers of the base model itself to 4160 prompts of `train_prompts.jsonl`" in card
    assert (
        "- Greedy answers of the base model itself to 9 prompts of `de.jsonl` (shuffle seed 0, from position 5)" in card
    )


def test_hub_folder_loads_back(tmp_path):
    model = tiny_model("llama")
    heads = random_heads(model, num_heads=2)
    folder = save_hub_folder(heads, tmp_path, "me/heads", training_log=LOG)
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    drafter = hf_bpd.BlockDrafter.from_pretrained(folder, top_k=3)
    drafter.prepare(model)
    for a, b in zip(heads.parameters(), drafter.heads.parameters()):
        assert torch.equal(a, b)


def test_push_to_hub_uploads_the_hub_folder(monkeypatch):
    """The network call itself is replaced; everything before it runs."""
    import huggingface_hub

    seen = {}

    class FakeApi:
        def __init__(self, token=None):
            pass

        def create_repo(self, repo_id, private=None, exist_ok=False):
            seen["repo"] = repo_id

        def upload_folder(self, repo_id, folder_path, commit_message):
            from pathlib import Path

            seen["files"] = sorted(p.name for p in Path(folder_path).iterdir())
            seen["card"] = (Path(folder_path) / "README.md").read_text()
            return "ok"

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    heads = random_heads(tiny_model("llama"), num_heads=2)
    assert heads.push_to_hub("me/heads", training_log=LOG) == "ok"
    assert seen["repo"] == "me/heads" and seen["files"] == ["README.md", "config.json", "model.safetensors"]
    assert "0.610" in seen["card"]


def test_corrupt_heads_file_raises_clearly(tmp_path):
    heads = random_heads(tiny_model("llama"), num_heads=2)
    heads.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="corrupt"):
        hf_bpd.BlockDraftHeads.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        hf_bpd.BlockDraftHeads.from_pretrained(tmp_path)


def test_a_model_folder_is_not_heads(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not a draft-heads checkpoint"):
        hf_bpd.BlockDrafter.from_pretrained(tmp_path)
