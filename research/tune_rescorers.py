"""Choose the shipped rescorers' weights (n-gram alpha, context mixture lam, neural alpha) by measurement.

Tuning slice: every 18th row of spec_bench_dev starting at row 4 (14 rows, all large categories). It is
disjoint from the rows `hf-bpd bench --spread 13` or `--spread 26` reports on (every 18th / 9th from
row 0), so the reported numbers are not fitted. Criterion: tau (block efficiency) with one shared
forward-cost curve, so the choice does not depend on machine noise; the rescorers' own cost (~1-2 ms
per step for the n-gram searches, see docs/history.md) is small next to a verification forward.

Stage 1 tunes each rescorer alone; stage 2 builds the p-best variants and the "best" combination from the
stage-1 winners. Writes rescorers.json (the specs `load_packaged_drafter(rescorer=NAME)` builds).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import hf_bpd
from hf_bpd.drafting.rescoring.composed import build_rescorer
from hf_bpd.io.jsonl import read_jsonl
from hf_bpd.tools.bench import bpd_method, greedy_method, run_bench
from research import SPEC_BENCH_DEV

NGRAM = "ngram/ngram.arpa.gz"


def tuning_rows(path: str) -> list[dict]:
    return read_jsonl(path)[4::18]


def measure(model, tokenizer, base, folder, specs: dict[str, dict], rows, max_new_tokens) -> dict[str, float]:
    methods = [greedy_method(model), bpd_method(model, base, "heads")]
    for name, spec in specs.items():
        methods.append(bpd_method(model, base.with_rescorer(build_rescorer(spec, folder, tokenizer)), name))
    results = run_bench(model, tokenizer, rows, methods, max_new_tokens)
    taus = {}
    for name, r in results.items():
        if not r["overall"]["identical"]:
            raise SystemExit(f"{name} differs from greedy: not lossless")
        taus[name] = r["overall"]["tau"]
        print(json.dumps({"config": name, "spec": specs.get(name), **r["overall"]}))
    return taus


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m research.tune_rescorers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--assets", default="hf_bpd/assets/smollm2", help="folder with ngram/ (and rescorer/)")
    parser.add_argument("--data", default=SPEC_BENCH_DEV)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--alphas", type=float, nargs="+", default=[0.25, 0.5, 1.0])
    parser.add_argument("--lams", type=float, nargs="+", default=[0.2, 0.4, 0.6])
    parser.add_argument("--extends", type=int, nargs="+", default=[0, 6], help="context_extend values")
    parser.add_argument("--neural-alphas", type=float, nargs="+", default=[0.5, 1.0])
    parser.add_argument("--neural-only", action="store_true", help="only measure the neural alphas (stage 1)")
    parser.add_argument("--output", default=None, help="rescorers.json to write")
    args = parser.parse_args(argv)

    from hf_bpd.io.models import load_model
    from hf_bpd.io.packaged import load_packaged_drafter

    model, tokenizer = load_model("packaged")
    folder = Path(args.assets)
    base = load_packaged_drafter()
    hf_bpd.prepare(base, model)  # measures the forward-cost curve ("auto" trees) that every config then shares
    rows = tuning_rows(args.data)
    has_neural = (folder / "rescorer").is_dir()

    neural = {f"neural-a{a}": {"type": "neural", "lm": "rescorer", "alpha": a} for a in args.neural_alphas}
    if args.neural_only:
        measure(model, tokenizer, base, folder, neural, rows, args.max_new_tokens)
        return 0
    stage1 = {f"ngram-a{a}": {"type": "ngram", "lm": NGRAM, "alpha": a, "num_paths": 1, "beam": 8} for a in args.alphas}
    stage1 |= {
        f"context-l{lam}-e{e}": {
            "type": "ngram",
            "lm": None,
            "context_weight": lam,
            "num_paths": 4,
            "beam": 8,
            "context_extend": e,
        }
        for lam in args.lams
        for e in args.extends
    }
    if has_neural:
        stage1 |= neural
    taus = measure(model, tokenizer, base, folder, stage1, rows, args.max_new_tokens)

    winners = {
        kind: max((n for n in stage1 if n.startswith(kind + "-")), key=taus.get) for kind in ("ngram", "context")
    }
    if has_neural:
        winners["neural"] = max(neural, key=taus.get)
    chosen = {kind: stage1[name] for kind, name in winners.items()}
    ngram, context = chosen["ngram"], chosen["context"]
    stage2 = {
        "ngram_p4": {**ngram, "num_paths": 4, "beam": 8},
        "ngram_p16": {**ngram, "num_paths": 16, "beam": 16},
        "ngram+context": {
            **ngram,
            "num_paths": 4,
            "beam": 8,
            "context_weight": context["context_weight"],
            "context_extend": context["context_extend"],
        },
    }
    if has_neural:
        stage2["neural+ngram+context"] = {"type": "compose", "parts": [chosen["neural"], stage2["ngram+context"]]}
    taus2 = measure(model, tokenizer, base, folder, stage2, rows, args.max_new_tokens)
    candidates = {**chosen, **stage2}
    candidate_taus = {**{kind: taus[name] for kind, name in winners.items()}, **taus2}
    chosen |= {name: stage2[name] for name in ("ngram_p4", "ngram_p16", "ngram+context")}
    best = max(candidates, key=candidate_taus.get)
    chosen["best"] = {**candidates[best], "description": f"{best}: highest tau on the tuning slice"}
    print("chosen:", json.dumps(chosen, indent=2))
    if args.output:
        Path(args.output).write_text(json.dumps(chosen, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
