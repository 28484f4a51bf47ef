"""Per-head accuracy of saved heads on a training run's held-out samples, one row per data source.

A `hf-bpd train-heads` run over several distilled folders holds out a fraction of the samples of all of
them together (`train_heads.split_by_sample`), and its log gives one figure over the mixture. This reads
the same split from the run's features cache and scores each head set on each folder's held-out samples
apart, so that a continuation can be compared with the heads it started from where the data differs in
kind (e.g. the T0 tasks of distill2 against the model's own chat prompts).

    python -m research.heads_by_source --data runs/d54_89 training/data/distilled/distill_instr \
        training/data/distilled/distill_self --features-cache runs/features_54_89 \
        --heads runs/heads5_from_v7 runs/h10_mix_deep2 --output benchmarks/replay/mix_training/by_source.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hf_bpd.drafting.heads import BlockDraftHeads
from hf_bpd.io.models import load_model
from hf_bpd.training.distill import load_distilled
from hf_bpd.training.train_heads import cached_features, evaluate, split_by_sample


def held_out_by_source(model, folders: list[str], heads_paths: list[str], cache: str, val_fraction: float, seed: int):
    """{heads path: {folder: train_heads.evaluate on that folder's held-out samples}}."""
    sizes = [len(load_distilled(folder)) for folder in folders]
    data = load_distilled(folders)
    heads = [BlockDraftHeads.from_pretrained(path).bind(model).eval() for path in heads_paths]
    feats = cached_features(model, data, max(h.num_heads for h in heads), cache, progress=False)
    _, val = split_by_sample(feats, val_fraction, seed)
    samples, starts = feats.sample[val], [sum(sizes[:i]) for i in range(len(sizes))]
    held_out = {
        folder: feats.select(val[(samples >= start) & (samples < start + size)])
        for folder, start, size in zip(folders, starts, sizes)
    }
    return {
        path: {folder: evaluate(head_set, rows, top_k=5) for folder, rows in held_out.items()}
        for path, head_set in zip(heads_paths, heads)
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m research.heads_by_source", description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", nargs="+", required=True, help="the run's --data folders, in its order")
    parser.add_argument("--features-cache", required=True, help="the run's --features-cache")
    parser.add_argument("--heads", nargs="+", required=True)
    parser.add_argument("--val-fraction", type=float, default=0.05, help="the run's --val-fraction")
    parser.add_argument("--seed", type=int, default=0, help="the run's --seed")
    parser.add_argument("--model", default="packaged")
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    model, _ = load_model(args.model, device="cpu", with_tokenizer=False)
    results = held_out_by_source(model, args.data, args.heads, args.features_cache, args.val_fraction, args.seed)
    for path, by_folder in results.items():
        for folder, r in by_folder.items():
            top1 = "/".join(f"{a:.3f}" for a in r["top1"])
            print(f"{path}  {folder}: top-1 {top1}, oracle {r['oracle_top5']:.2f}, {r['positions']} positions")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"args": vars(args), "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
