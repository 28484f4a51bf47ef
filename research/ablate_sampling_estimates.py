"""Same-run ablation of the drafter's sampling-aware acceptance estimates (`calibration.SamplingWarp`).

Sampled calls warp the heads' estimates like the base model's draws (temperature, top-p) and calibrate them
apart from greedy calls. This script decodes the tuning slice of Spec-Bench (every 18th row from row 4,
disjoint from the report's per-category rows) with seeded plain sampling, the shipped drafter and the same
drafter with greedy-style (unwarped) estimates, interleaved, then the same rows greedily with the shipped
drafter, and prints each τ, tokens/s and the ratio of sampled to greedy τ (the goal of issue #20 is 85 %).

    python -m research.ablate_sampling_estimates --temperature 0.7 --top-p 0.9 --output benchmarks/x.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hf_bpd.decode.cost import measure_forward_cost
from hf_bpd.io.models import load_model
from hf_bpd.io.packaged import load_packaged_drafter
from hf_bpd.tools.bench import (
    bpd_method,
    environment,
    greedy_method,
    learned,
    markdown_table,
    run_bench,
)
from research import SPEC_BENCH_DEV
from research.tune_rescorers import tuning_rows


def unwarped(drafter):
    """`drafter` drafting every call as if greedy (the estimates before `SamplingWarp`)."""
    draft = drafter.draft

    def greedy_style(*args, warp=None, **kwargs):
        return draft(*args, **kwargs)

    drafter.draft = greedy_style
    return drafter


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=SPEC_BENCH_DEV)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-tree-tokens", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)

    env = environment("cpu", "float32")  # before the run writes anything
    model, tokenizer = load_model()
    size = args.max_tree_tokens if args.max_tree_tokens == "auto" else int(args.max_tree_tokens)
    shipped, greedy_style, greedy_run = (load_packaged_drafter(max_tree_tokens=size) for _ in range(3))
    curve = measure_forward_cost(model, packed_linear=shipped.packed_linear) if size == "auto" else None
    for drafter in (shipped, greedy_style, greedy_run):
        drafter.profile = True
        drafter.forward_cost = curve
    unwarped(greedy_style)
    sampling = {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p}
    rows = tuning_rows(args.data)
    sampled_methods = [
        greedy_method(model, sampling),
        bpd_method(model, shipped, "hf_bpd", sampling),
        bpd_method(model, greedy_style, "hf_bpd unwarped", sampling),
    ]
    sampled = run_bench(model, tokenizer, rows, sampled_methods, args.max_new_tokens, seed=args.seed)
    greedy_methods = [greedy_method(model), bpd_method(model, greedy_run, "hf_bpd greedy")]
    greedy = run_bench(model, tokenizer, rows, greedy_methods, args.max_new_tokens)
    print(markdown_table(sampled))
    print(markdown_table(greedy))
    greedy_tau = greedy["hf_bpd greedy"]["overall"]["tau"]
    ratios = {name: sampled[name]["overall"]["tau"] / greedy_tau for name in ("hf_bpd", "hf_bpd unwarped")}
    print(json.dumps({"sampled_over_greedy_tau": ratios}, indent=1))
    if args.output:
        report = {
            "environment": env,
            "args": vars(args),
            "rows": len(rows),
            "sampled": sampled,
            "greedy": greedy,
            "sampled_over_greedy_tau": ratios,
            "learned": learned(sampled_methods + greedy_methods),
        }
        Path(args.output).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
