"""How well the drafter's calibrated acceptance estimates order a tree's nodes: a reliability table.

Replays greedy answers (as `hf-bpd replay` does) with one drafter at a fixed tree size and logs every drafted
arc whose parent the base model reached: its source, depth, raw estimate, calibrated estimate at the time,
and whether it was accepted. Per (source kind, depth) and raw-estimate bin it prints the mean calibrated
estimate beside the measured acceptance rate: where their ratio moves with the raw estimate, a single
multiplier per (source, depth) misorders siblings against deeper nodes, and small trees pay for it.

    PYTHONPATH=/tmp/tf524env python -m research.calibration_reliability --spread 40 --max-tree-tokens 16 \
        --output benchmarks/replay/calibration_reliability_spread40.json
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path

from hf_bpd.drafting.calibration import AcceptanceCalibration
from hf_bpd.io.models import load_model
from hf_bpd.tools.bench import environment, load_drafter, read_prompts, select_rows
from hf_bpd.tools.replay import read_answers, replay
from research import SPEC_BENCH_DEV

BINS = (0.9, 0.7, 0.5, 0.3, 0.1, 0.03, 0.0)  # lower edges of raw-estimate bins


def source_kind(source: str) -> str:
    return source.rstrip("0123456789")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=SPEC_BENCH_DEV)
    parser.add_argument("--answers", default="benchmarks/replay/spec_bench_dev_greedy128.jsonl")
    parser.add_argument("--heads", default="packaged")
    parser.add_argument("--spread", type=int, default=40)
    parser.add_argument("--max-tree-tokens", type=int, default=16)
    parser.add_argument("--context-lookup", type=int, default=10)
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)

    env = environment("cpu", "float32")  # before anything is written
    model, tokenizer = load_model("packaged")
    drafter = load_drafter(args.heads, model, max_tree_tokens=args.max_tree_tokens, context_lookup=args.context_lookup)
    rows = select_rows(read_prompts(args.data), None, None, None, args.spread)
    _, answers = read_answers(args.answers)
    records = []
    observe = AcceptanceCalibration.observe

    def logged(self, arc, depth, accepted):
        if arc.logprob != -math.inf:
            records.append(
                (source_kind(arc.source), depth, math.exp(arc.logprob), math.exp(self.calibrated(arc, depth)), accepted)
            )
        observe(self, arc, depth, accepted)

    AcceptanceCalibration.observe = logged
    try:
        result = replay(model, tokenizer, rows, answers, {"drafter": drafter}, progress=False)
    finally:
        AcceptanceCalibration.observe = observe
    table = defaultdict(lambda: [0, 0.0, 0.0])  # (kind, depth, bin) -> count, sum calibrated, accepted
    for kind, depth, raw, calibrated, accepted in records:
        low = next(edge for edge in BINS if raw >= edge)
        cell = table[(kind, min(depth, 4), low)]
        cell[0] += 1
        cell[1] += calibrated
        cell[2] += accepted
    lines = [
        "| source | depth | raw estimate ≥ | arcs | mean calibrated | accepted | accepted / calibrated |",
        "|---|---|---|---|---|---|---|",
    ]
    summary = []
    for (kind, depth, low), (n, est, acc) in sorted(table.items(), key=lambda kv: (kv[0][0], kv[0][1], -kv[0][2])):
        ratio = acc / est if est else float("nan")
        lines.append(f"| {kind} | {depth} | {low} | {n} | {est / n:.3f} | {acc / n:.3f} | {ratio:.2f} |")
        summary.append(
            {"source": kind, "depth": depth, "raw_at_least": low, "arcs": n, "calibrated": est / n, "accepted": acc / n}
        )
    print(f"tau {result['drafter']['overall']['tau']:.3f}")
    print("\n".join(lines))
    if args.output:
        Path(args.output).write_text(
            json.dumps(
                {"environment": env, "args": vars(args), "tau": result["drafter"]["overall"], "cells": summary},
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
