"""research.heads_by_source: a run's held-out samples scored per data folder."""

import pytest
import torch
from conftest import random_heads, tiny_distilled, tiny_model

from hf_bpd import BlockDraftHeads
from hf_bpd.training.distill import load_distilled
from hf_bpd.training.train_heads import cached_features, evaluate, split_by_sample
from research.heads_by_source import held_out_by_source


def test_each_folders_held_out_samples_are_scored_apart_and_together_make_the_run_s_validation(tmp_path):
    """The folders' held-out positions partition the run's validation (same split, same cache), so their
    accuracies weighted by positions give the figure the run itself reports over the mixture."""
    model = tiny_model("llama", eos_token_id=None)
    folders = []
    for seed in (0, 1):
        folder = tmp_path / f"distilled{seed}"
        tiny_distilled(model, n=10, new=12, seed=seed).save_to_disk(str(folder))
        folders.append(str(folder))
    random_heads(model, num_heads=2, token_input="previous").save_pretrained(tmp_path / "heads")
    cache = str(tmp_path / "features")
    results = held_out_by_source(model, folders, [str(tmp_path / "heads")], cache, val_fraction=0.4, seed=0)
    by_folder = results[str(tmp_path / "heads")]
    assert list(by_folder) == folders

    feats = cached_features(model, load_distilled(folders), 2, cache, progress=False)
    _, val = split_by_sample(feats, 0.4, 0)
    held_out = set(feats.sample[val].tolist())
    assert any(s < 10 for s in held_out) and any(s >= 10 for s in held_out)  # both folders are scored
    heads = BlockDraftHeads.from_pretrained(tmp_path / "heads").bind(model).eval()
    whole = evaluate(heads, feats.select(val), top_k=5)
    assert sum(r["positions"] for r in by_folder.values()) == whole["positions"]
    for head in range(2):
        weighted = sum(r["top1"][head] * r["positions"] for r in by_folder.values()) / whole["positions"]
        assert weighted == pytest.approx(whole["top1"][head], abs=1e-6)
    assert torch.isfinite(torch.tensor([r["oracle_top5"] for r in by_folder.values()])).all()
