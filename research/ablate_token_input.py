"""Same-data ablation of head training choices: the heads' token input (`hf-bpd train-heads --token-input`)
and any other `train-heads` option.

Trains each variant on the first `--samples` distilled samples with identical settings (one shared
feature cache, same held-out samples, same seed) and prints per-head validation accuracy after each epoch.
A variant is a token input,
  none      plain Medusa heads
  next      heads that also read token t+1
  previous  head i also reads token t+i, the one before its target
or a quoted string of `train-heads` options that replace the defaults below, e.g.
"--token-input previous --teacher-weight 0.5".

    python -m research.ablate_token_input --data runs/distill2 --samples 896 --features-cache runs/heads2/features \
        --variants next none --output benchmarks/next_token_ablation.json
    python -m research.ablate_token_input ... --variants previous "--token-input previous --teacher-weight 0.5"
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from hf_bpd.training import train_heads


def variant_args(variant: str) -> list[str]:
    """`train-heads` options of a variant: a bare token input means `--token-input` it."""
    return ["--token-input", variant] if variant in train_heads.TOKEN_INPUT_CHOICES else shlex.split(variant)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="hf-bpd distill --output folder")
    parser.add_argument("--samples", type=int, default=896, help="first N distilled samples")
    parser.add_argument("--features-cache", required=True)
    parser.add_argument("--num-heads", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--variants", nargs="+", default=["previous", "next"], help="token inputs or option strings")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)

    from hf_bpd.io.models import load_model
    from hf_bpd.training.distill import load_distilled

    model, _ = load_model("packaged")
    data = load_distilled(args.data)
    if len(data) < args.samples:
        raise ValueError(f"{args.data} holds {len(data)} samples, fewer than --samples {args.samples}")
    data = data.select(range(args.samples))
    results = {}
    for variant in args.variants:
        parser = argparse.ArgumentParser()
        train_heads.add_args(parser)
        # the shipped recipe's settings (training/recipes/smollm2.sh), fewer epochs
        train_args = parser.parse_args(
            [
                "--data", args.data, "--output", "unused", "--features-cache", args.features_cache,
                "--num-heads", str(args.num_heads), "--draft-vocab-size", "8192", "--loss-decay", "0.8",
                "--epochs", str(args.epochs), "--lr", "2e-3", "--batch-size", "256", "--top-k", "5",
                "--log-every", "0", "--no-progress", *variant_args(variant),
            ]
        )  # fmt: skip
        _, history = train_heads.train_frozen(model, data, train_args)
        results[variant] = history
    text = json.dumps({"args": vars(args), "results": results}, indent=2)
    if args.output:
        Path(args.output).write_text(text)
    for name, history in results.items():
        last = history[-1]
        print(name, "top1", [round(v, 3) for v in last["top1"]], "top5", [round(v, 3) for v in last["top5"]])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
