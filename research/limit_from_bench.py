"""The zero-overhead speed limit of each tree size, with t(n) from a speed run: τ(n)·t(1)/t(n).

    python -m research.limit_from_bench --replay R.json --bench B.json --output L.json

τ(n) comes from `hf-bpd replay` with fixed tree sizes (R); t(n) from the forward-cost curves the bench run B
measured at its start (the mean over its parts when B was merged from several), so the limit stands beside
that run's speed with the same machine state. Writes R's contents plus "limits" and the curve used.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hf_bpd.decode.cost import ForwardCost, speedup_bound


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m research.limit_from_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--replay", required=True)
    parser.add_argument("--bench", required=True)
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    report = json.loads(Path(args.replay).read_text())
    bench = json.loads(Path(args.bench).read_text())
    curves = [p["forward_cost"] for p in bench.get("parts", [])] or [bench["forward_cost"]]
    sizes = curves[0][0]
    seconds = [sum(c[1][i] for c in curves) / len(curves) for i in range(len(sizes))]
    curve = ForwardCost(tuple(sizes), tuple(seconds))
    report["limits"] = []
    for name, result in report["drafters"].items():
        n = int(name.split(" n")[1].split()[0])
        tau = result["overall"]["tau"]
        limit = speedup_bound(tau, curve(1), curve(n))
        report["limits"].append(
            {"drafter": name, "tree_tokens": n, "tau": tau, "cost_ratio": curve(n) / curve(1), "limit": limit}
        )
    report["limit_curve"] = {"bench": args.bench, "parts": len(curves), "sizes": sizes, "seconds": seconds}
    Path(args.output).write_text(json.dumps(report, indent=2))
    for r in report["limits"]:
        print(f"n={r['tree_tokens']}: tau {r['tau']:.2f}, t(n)/t(1) {r['cost_ratio']:.2f}, limit {r['limit']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
