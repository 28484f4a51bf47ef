"""Same-run ablation of the drafter's online calibration (acceptance estimates + learned forward cost).

Runs greedy, prompt lookup and the shipped drafter with a rescorer, calibrated and not, interleaved on the
tuning slice of Spec-Bench (every 18th row from row 4: disjoint from the report's `--spread 13` rows), and
prints the bench tables plus the learned multipliers.

    python -m research.ablate_calibration --max-new-tokens 64 --output benchmarks/calibration_ablation.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hf_bpd.decode.cost import measure_forward_cost
from hf_bpd.io.models import load_model
from hf_bpd.io.packaged import load_packaged_drafter, packaged_rescorer
from hf_bpd.tools.bench import (
    bpd_method,
    greedy_method,
    learned,
    markdown_table,
    prompt_lookup_method,
    run_bench,
)
from research import SPEC_BENCH_DEV
from research.tune_rescorers import tuning_rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=SPEC_BENCH_DEV)
    parser.add_argument("--rescorer", default="context")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)

    model, tokenizer = load_model()
    drafter = load_packaged_drafter()
    drafter.profile = True
    drafter.forward_cost = measure_forward_cost(model, packed_linear=drafter.packed_linear)
    variants = {
        f"{args.rescorer} uncalibrated": drafter.with_rescorer(packaged_rescorer(args.rescorer, tokenizer)),
        f"{args.rescorer} calibrated": drafter.with_rescorer(packaged_rescorer(args.rescorer, tokenizer)),
        "heads calibrated": drafter.with_rescorer(None),
    }
    variants[f"{args.rescorer} uncalibrated"].calibration = None
    methods = [greedy_method(model), prompt_lookup_method(model)]
    methods += [bpd_method(model, d, name) for name, d in variants.items()]
    rows = tuning_rows(args.data)
    results = run_bench(model, tokenizer, rows, methods, args.max_new_tokens, progress=True)
    print(markdown_table(results))
    learned_values = learned(methods)
    print(json.dumps(learned_values, indent=1))
    if args.output:
        report = {"forward_cost": [drafter.forward_cost.sizes, drafter.forward_cost.seconds], "learned": learned_values}
        Path(args.output).write_text(json.dumps({**report, "rows": len(rows), "methods": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
