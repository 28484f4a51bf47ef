"""Per-head accuracy of saved heads on distilled data they were not trained on.

    python -m hf_bpd.training.evaluate_heads --heads packaged runs/heads5 --data runs/distill_heldout

Every position of every sample (teacher-forced, as `train-heads` validates each epoch): per-head top-1 and
top-k accuracy given the true tokens before each target, and the tree oracle (`train_heads.evaluate`).
Context-copy heads are scored by their mixture with the pointer. Several heads share one features cache.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from hf_bpd.training.copy_training import SampleTokens, feature_positions
from hf_bpd.training.objective import response_positions
from hf_bpd.training.train_heads import cached_features, evaluate


def evaluate_saved_heads(model, heads, data, features, top_k: int) -> dict:
    """`train_heads.evaluate` of `heads` (bound to `model`) on all of `data`'s cached `features`."""
    tokens = positions = None
    if heads.context_copy is not None:
        tokens = SampleTokens.build(data, response_positions)
        positions = feature_positions(features.sample, tokens)
    return evaluate(heads, features, top_k, 512, tokens, positions)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hf_bpd.training.evaluate_heads", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--heads", nargs="+", required=True, help="heads folders, or 'packaged'")
    parser.add_argument("--data", nargs="+", required=True, help="hf-bpd distill --output folders")
    parser.add_argument("--model", default="packaged")
    parser.add_argument("--features-cache", required=True, help="where the base model's hidden states are cached")
    parser.add_argument("--top-k", type=int, default=5)
    parser.add_argument("--output", default=None, help="JSON file of the results")
    args = parser.parse_args(argv)

    from hf_bpd.drafting.heads import BlockDraftHeads
    from hf_bpd.io.models import load_model
    from hf_bpd.io.packaged import packaged_heads_dir, resolve_packaged_name
    from hf_bpd.training.distill import load_distilled

    model, _ = load_model(args.model, with_tokenizer=False)
    data = load_distilled(args.data)
    loaded = {}
    for name in args.heads:
        path = packaged_heads_dir(resolve_packaged_name(args.model)) if name == "packaged" else Path(name)
        loaded[name] = BlockDraftHeads.from_pretrained(path).bind(model).float().eval()
    most_heads = max(h.num_heads for h in loaded.values())
    kinds = {tuple(h.config.feature_layers or ()) for h in loaded.values()}  # heads reading other layers
    features = {
        kind: cached_features(model, data, most_heads, args.features_cache, feature_layers=list(kind) or None)
        for kind in kinds
    }
    results = {"data": args.data, "samples": len(data), "top_k": args.top_k, "heads": {}}
    for name, heads in loaded.items():
        feats = features[tuple(heads.config.feature_layers or ())]
        if heads.num_heads < most_heads:
            feats = type(feats)(feats.hidden, feats.targets[:, : heads.num_heads], feats.next_token, feats.sample)
        with torch.no_grad():
            results["heads"][name] = evaluate_saved_heads(model, heads, data, feats, args.top_k)
        print(name, json.dumps(results["heads"][name]))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
