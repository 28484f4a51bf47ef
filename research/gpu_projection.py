"""A PROJECTION, not a measurement: what the captured decode step (`hf_bpd/decode/captured.py`) should give on
an H200, from the cost model with the step's overhead, before any GPU run of the step itself.

    projected tokens/s (n) = τ(n) / (t(n) + X)        against plain static-cache generate: 1 / g

  τ(n)  the captured step's τ with trees of n nodes, each kind the step builds: a FIXED tree
        (`Topology.best_first`, rank prior), trees GROWN each step by the best-first search, and grown trees
        with the context-lookup chain merged in (LOOKUP), and those with the calibration learning on the
        device from every walk (LEARNED, what the step runs for the shipped heads); shipped
        heads, top-k 10, on the real SmolLM2-135M-Instruct in float32, 128 new tokens, Spec-Bench dev rows
        (`research/captured_tau.py --replay`, --tau's file). τ is a count, the same on any machine for the
        same tokens (float32).
  t(n)  a tree forward of n tokens on a static cache in a captured CUDA graph on an H200 (claim
        `gpu_graph_trees_h200`, benchmarks/gpu/graph_trees_h200.json, random weights, 256 cached tokens),
        taken conservatively: the largest time measured at any size up to the first measured size >= n
        (135m float32 measured 1, 4, 16, 64 tokens; 1b bfloat16 1 and 16: its n = 32 is an EXTRAPOLATION,
        t(16), flagged, the forward being flat from 1 to 128 tokens eagerly there, claim `cost_model_h200`).
  X     the step's work besides the forward: the heads (5 one-layer heads on one hidden state, their
        8192-token draft projections and top-k), the greedy accept (argmax, path compare), the compaction
        (`index_copy_` of the kept keys and values into every layer) and the one pinned host read. In one
        captured graph these are a few hundred small kernels at a few microseconds each on an H200:
        ASSUMED X = 1.0 ms (central) and shown at 0.5 and 2.0 ms (a grown tree's search adds a few rounds
        of the heads and a top-k each, and the lookup one pass over the sequence buffer: toward 2 ms).
        Not measured: research/gpu/captured_step.py
        measures the whole step (its `ms_per_step`) on the next lease and replaces this.
  g     plain greedy `generate` on a static cache (transformers' compiled step, CUDA graphs) per token on an
        H200 (claims `gpu_plain_generate_135m_fp32_h200`: 3.72 ms; `gpu_plain_generate_1b_bf16_h200`: 2.46 ms;
        random weights, 256-token prompt).

For the 1b shape τ is SmolLM2's (an assumption: only the costs are that shape's), as in those claims.

    python -m research.gpu_projection --output benchmarks/gpu/captured_projection_h200.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "benchmarks" / "gpu"
OVERHEADS_MS = (0.5, 1.0, 2.0)
CENTRAL_MS = 1.0
PLAIN = {
    ("135m", "float32"): "plain_generate_135m_fp32_h200.json",
    ("1b", "bfloat16"): "plain_generate_1b_bf16_h200.json",
}


def graph_forward_s(rows: list[dict], shape: str, n: int) -> tuple[float, bool]:
    """(t(n), extrapolated): the largest graph forward time measured at a size up to the first measured size
    >= n; past the largest measured size, the largest time measured (extrapolated)."""
    times = {r["tree_tokens"]: r["graph_forward_s"] for r in rows if r["shape"] == shape}
    above = [m for m in times if m >= n]
    if not above:
        return max(times.values()), True
    cap = min(above)
    return max(t for m, t in times.items() if m <= cap), False


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tau", default=str(GPU / "captured_tau_smollm2_cpu.json"))
    parser.add_argument("--output", default=str(GPU / "captured_projection_h200.json"))
    args = parser.parse_args(argv)
    tau_report = json.loads(Path(args.tau).read_text())
    graph = json.loads((GPU / "graph_trees_h200.json").read_text())
    rows = []
    for (shape, dtype), name in PLAIN.items():
        g = json.loads((GPU / name).read_text())["plain_generate_s_per_token"][shape]["static"]
        trees = ("fixed", "grown", "lookup", "learned")
        for t in sorted(
            tau_report["sizes"].values(), key=lambda r: (trees.index(r.get("tree", "fixed")), r["tree_tokens"])
        ):
            n = t["tree_tokens"]
            forward, extrapolated = graph_forward_s(graph["rows"], shape, n)
            row = {
                "shape": shape,
                "dtype": dtype,
                "tree": t.get("tree", "fixed"),
                "tree_tokens": n,
                "tau": t["tau"],
                "graph_forward_ms": 1e3 * forward,
                "forward_extrapolated": extrapolated,
                "plain_static_ms_per_token": 1e3 * g,
                "plain_static_tokens_per_s": 1 / g,
            }
            for x in OVERHEADS_MS:
                step = forward + x / 1e3
                row[f"x{x:g}ms"] = {
                    "step_ms": 1e3 * step,
                    "tokens_per_s": t["tau"] / step,
                    "speedup": t["tau"] * g / step,
                }
            rows.append(row)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    report = {
        "environment": {
            "date": datetime.date.today().isoformat(),
            "commit": commit + ("+uncommitted changes" if dirty else ""),
            "device": "projection (no GPU run): H200 costs from claims gpu_graph_trees_h200, gpu_plain_generate_*_h200",
            "dtype": "float32 (135m), bfloat16 (1b); τ measured in float32",
            "torch": tau_report.get("torch"),
            "transformers": tau_report.get("transformers", "5.24.0"),
        },
        "projection": True,
        "overhead_ms_assumed": list(OVERHEADS_MS),
        "overhead_ms_central": CENTRAL_MS,
        "tau_source": {k: v for k, v in tau_report.items() if k != "sizes"},
        "sources": ["benchmarks/gpu/graph_trees_h200.json", *(f"benchmarks/gpu/{n}" for n in PLAIN.values()), args.tau],
        "rows": rows,
    }
    Path(args.output).write_text(json.dumps(report, indent=1) + "\n")
    for r in rows:
        c = r[f"x{CENTRAL_MS:g}ms"]
        print(
            f"{r['shape']} {r['dtype']} {r['tree']} n={r['tree_tokens']}: tau {r['tau']:.2f}, "
            f"t(n) {r['graph_forward_ms']:.2f} ms"
            f"{' (extrapolated)' if r['forward_extrapolated'] else ''}, step {c['step_ms']:.2f} ms -> "
            f"{c['tokens_per_s']:.0f} tok/s vs plain {r['plain_static_tokens_per_s']:.0f} ({c['speedup']:.2f}x; "
            + ", ".join(f"X={x:g}: {r[f'x{x:g}ms']['speedup']:.2f}x" for x in OVERHEADS_MS)
            + ")"
        )


if __name__ == "__main__":
    main()
