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
    hf_bpd.prepare(drafter, model)
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


def test_shipped_cards_are_what_the_assets_give():
    """`python -m hf_bpd.training.ship --check`: every head set shipped in the package has its card in
    model_cards/, rendered from the template and its assets as they are now (after a change of either, write
    them again with `python -m hf_bpd.training.ship --cards`); model_cards/ holds nothing else."""
    from hf_bpd.card import CHECKOUT_CARDS, TEMPLATE
    from hf_bpd.training.ship import check_cards, shipped_head_sets

    shipped = shipped_head_sets()
    assert "smollm2-135m-instruct" in shipped
    assert check_cards() == []
    assert sorted(p.name for p in CHECKOUT_CARDS.iterdir()) == sorted([TEMPLATE, *(f"{n}.md" for n in shipped)])
    card = (CHECKOUT_CARDS / "smollm2-135m-instruct.md").read_text()
    assert 'hf_bpd.load_packaged_drafter(model="smollm2-135m-instruct")' in card
    assert "| **overall** |" in card and "apply_chat_template" in card  # τ measured; an instruct model


def test_a_stale_card_is_reported_and_written_again(tmp_path):
    from hf_bpd.card import CHECKOUT_CARDS
    from hf_bpd.training.ship import check_cards, shipped_head_sets

    for name in shipped_head_sets():
        (tmp_path / f"{name}.md").write_text((CHECKOUT_CARDS / f"{name}.md").read_text() + "edited by hand\n")
    assert check_cards(tmp_path) == list(shipped_head_sets())
    assert check_cards(tmp_path, write=True) == list(shipped_head_sets())
    assert check_cards(tmp_path) == []


def template_lines() -> list[str]:
    """The template's lines without a placeholder: a card rendered from it holds each of them."""
    from hf_bpd.card import CHECKOUT_CARDS, TEMPLATE

    text = (CHECKOUT_CARDS / TEMPLATE).read_text()
    return [line for line in text.splitlines() if line.strip() and "{" not in line]


def test_save_pretrained_writes_the_card_of_the_template(tmp_path, monkeypatch):
    """`BlockDrafter.save_pretrained`'s README.md is model_cards/template.md filled in: its fixed lines all
    there, and a change to the template shows in the card."""
    from hf_bpd import card as card_module

    heads = random_heads(tiny_model("llama"), num_heads=2)
    drafter = hf_bpd.BlockDrafter(heads, top_k=3, max_tree_tokens=8)
    folder = drafter.save_pretrained(tmp_path / "a", repo_id="me/drafter", training_log=LOG)
    written = (folder / "README.md").read_text()
    assert written == render_card(heads, "me/drafter", training_log=LOG, top_k=3, max_tree_tokens=8, self_loading=True)
    lines = template_lines()
    assert len(lines) > 10 and all(line in written for line in lines)
    assert "## Usage\n\n```python\nimport hf_bpd\n\nfrom transformers import" in written
    edited = card_module.template_text() + "\nA line added to the template.\n"
    monkeypatch.setattr(card_module, "template_text", lambda: edited)
    folder = drafter.save_pretrained(tmp_path / "b", repo_id="me/drafter")
    assert "A line added to the template." in (folder / "README.md").read_text()


def test_a_base_model_card_writes_its_prompt_format():
    """Heads distilled from a base model's prompts (`hf-bpd distill --prompt-template qa`): the card's usage
    and data recipe show that format, not a chat template."""
    heads = random_heads(tiny_model("llama"), num_heads=2)
    qa = {**MANIFEST, "prompt_template": "Question: {prompt}\nAnswer:"}
    card = render_card(heads, "me/heads", manifest=qa, packaged="gemma-3-270m", settings={"top_k": 10})
    assert "apply_chat_template" not in card and "), chat template," not in card
    assert 'inputs = tokenizer("Question: Hi!\\nAnswer:", return_tensors="pt")' in card
    assert "prompts written as 'Question: {prompt}\\nAnswer:', no chat template" in card
    assert 'hf_bpd.load_packaged_model("gemma-3-270m")' in card and "(`drafter.json`: top_k=10)" in card


def test_the_wheel_ships_the_template():
    """setup.py installs the repository's model_cards/ as hf_bpd/model_cards/, where `template_text` reads
    it in an installed package (checked by building: `pip wheel . -w /tmp/wheel --no-deps`)."""
    from pathlib import Path

    setup = (Path(__file__).resolve().parents[1] / "setup.py").read_text()
    assert '"hf_bpd.model_cards"' in setup and 'package_dir={"hf_bpd.model_cards": "model_cards"}' in setup
    assert '"hf_bpd.model_cards": ["*.md"]' in setup


def test_continued_heads_say_their_validation_accuracy_is_an_upper_bound():
    from hf_bpd.card import accuracy_table

    fresh = accuracy_table(LOG)
    continued = accuracy_table({**LOG, "args": {"init": "runs/earlier_heads"}})
    assert "upper bound" not in fresh
    assert continued.startswith(fresh) and "upper bound" in continued


def test_a_fused_layer_s_card_says_which_layers_it_reads():
    from hf_bpd.drafting.eagle import EagleDraftLayer

    model = tiny_model()
    plain = EagleDraftLayer.for_base_model(model)
    fused = EagleDraftLayer.for_base_model(model, feature_layers=[1, -1])
    assert "reads the\nbase model's final hidden state there and the token" in render_card(plain)
    card = render_card(fused, packaged="gemma-3-270m", settings={"top_k": 10})
    assert "hidden states there after layers 1 and its final state, fused as EAGLE-3 does" in card
    assert "This layer ships inside hf_bpd" in card and "## Training\n\n_not recorded_" in card
