"""Drafter folders that load themselves (`BlockDrafter.save_pretrained` / `push_to_hub`, `hf_bpd.io.hub`),
offline: a local folder stands for the Hub repo, and the upload is faked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_model

import hf_bpd
from hf_bpd import BlockDrafter, BlockDraftHeads
from hf_bpd.drafting.rescoring.composed import build_rescorer

CONTEXT_RESCORER = {"type": "ngram", "lm": None, "context_weight": 0.5, "num_paths": 2, "beam": 4}


def saved_drafter_setup(tmp_path):
    model = tiny_model("llama", eos_token_id=None)
    heads = BlockDraftHeads.for_base_model(model, num_heads=3, token_input="previous")
    drafter = BlockDrafter(
        heads, top_k=4, max_tree_tokens=10, context_lookup=0, rescorer=build_rescorer(CONTEXT_RESCORER)
    )
    folder = drafter.save_pretrained(tmp_path / "drafter", repo_id="me/drafter")
    return model, drafter, folder


def test_saved_folder_holds_heads_settings_card_and_strategy(tmp_path):
    _, drafter, folder = saved_drafter_setup(tmp_path)
    names = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    assert {"config.json", "model.safetensors", "drafter.json", "README.md", "custom_generate/generate.py"} <= names
    card = (folder / "README.md").read_text()
    assert card.startswith("---\n") and "library_name: hf_bpd" in card.split("---")[1]  # ModelCardData
    assert 'custom_generate="me/drafter"' in card and "max_tree_tokens=10" in card
    settings = json.loads((folder / "drafter.json").read_text())
    assert settings == {**drafter.settings(), "rescorer": CONTEXT_RESCORER}
    loaded = BlockDrafter.from_pretrained(folder)
    assert loaded.settings() == drafter.settings() and loaded.rescorer.spec == CONTEXT_RESCORER
    assert BlockDrafter.from_pretrained(folder, top_k=2).top_k == 2  # keyword arguments win


def test_generate_from_the_saved_folder_needs_no_assistant_and_equals_the_callable(tmp_path):
    model, drafter, folder = saved_drafter_setup(tmp_path)
    ids = torch.tensor([[5, 6, 7, 8]])
    kw = dict(do_sample=False, max_new_tokens=25)
    callable_out = model.generate(ids, **kw, custom_generate=hf_bpd.generate, assistant=drafter)
    steps = list(drafter.stats.accepted_lengths)
    hub_out = model.generate(ids, **kw, custom_generate=str(folder), trust_remote_code=True)
    assert hub_out.tolist() == callable_out.tolist() == model.generate(ids, **kw).tolist()
    saved = hf_bpd.io.hub.saved_drafter(str(folder))
    assert saved.stats.accepted_lengths == steps  # the same drafter, rebuilt from the folder
    other = BlockDrafter(BlockDraftHeads.for_base_model(model, num_heads=2), top_k=2, max_tree_tokens=4)
    explicit = model.generate(ids, **kw, custom_generate=str(folder), trust_remote_code=True, assistant=other)
    assert explicit.tolist() == callable_out.tolist() and other.stats.steps > 0  # an explicit assistant wins


def test_a_folder_without_a_saved_drafter_asks_for_an_assistant():
    model = tiny_model("llama")
    package = str(Path(hf_bpd.__file__).parent)  # holds custom_generate/ but no heads
    with pytest.raises(ValueError, match="assistant="):
        model.generate(torch.tensor([[5, 6]]), max_new_tokens=3, custom_generate=package, trust_remote_code=True)


def test_push_to_hub_uploads_exactly_the_saved_folder(tmp_path, monkeypatch):
    from huggingface_hub import HfApi

    _, drafter, folder = saved_drafter_setup(tmp_path)
    uploaded = {}

    def upload_folder(self, repo_id, folder_path, commit_message):
        root = Path(folder_path)
        uploaded.update({p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()})
        return f"https://hub.invalid/{repo_id}"

    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, private=None, exist_ok=False: repo_id)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    assert drafter.push_to_hub("me/drafter").endswith("me/drafter")
    saved = {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    assert uploaded == saved


def test_a_rescorer_without_a_spec_is_not_saved_silently(tmp_path):
    model = tiny_model("llama")
    rescorer = hf_bpd.NgramRescorer(context_weight=0.5)  # built by hand: no spec to save
    drafter = BlockDrafter(BlockDraftHeads.for_base_model(model, num_heads=2), rescorer=rescorer)
    with pytest.raises(ValueError, match="cannot be saved"):
        drafter.save_pretrained(tmp_path / "d")


def test_a_drafter_saved_back_into_the_folder_it_was_loaded_from_keeps_its_rescorer_files(tmp_path):
    from hf_bpd.drafting.rescoring.neural import save_truncated_lm, truncated_lm

    model = tiny_model("llama", num_hidden_layers=2, eos_token_id=None)
    save_truncated_lm(truncated_lm(model, 1), tmp_path / "source" / "layers", model)
    rescorer = build_rescorer({"type": "neural", "lm": "layers", "alpha": 0.5}, tmp_path / "source")
    drafter = BlockDrafter(BlockDraftHeads.for_base_model(model, num_heads=2), top_k=3, rescorer=rescorer)
    folder = drafter.save_pretrained(tmp_path / "drafter")
    before = {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    BlockDrafter.from_pretrained(folder).save_pretrained(folder)  # its rescorer files are already there
    after = {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    assert after == before and "rescorer/layers/layers.safetensors" in after
