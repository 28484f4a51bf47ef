"""A verification forward on a cache grown in place (`kv.GrowingLayer`, what decoding now runs on) against
the same forward on transformers' `DynamicLayer`, which concatenates (copies) every layer's cache in every
forward, by context length and tree size:

    python -m research.growing_cache --output benchmarks/kernels/growing_cache_smollm2_intel.json

The packaged model on the drafter's kernels (`hf_bpd.prepare`), each forward the very call decoding makes
(`cost.ForwardTimer`, cropped back after each), the two caches timed in turns (which goes first
alternates), median of `--repeats`. Run with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from transformers.cache_utils import DynamicLayer

import hf_bpd
from hf_bpd.decode.cost import ForwardTimer
from hf_bpd.io.models import load_model
from hf_bpd.kv import GrowingLayer
from hf_bpd.tools.bench import environment


def concatenating(timer: ForwardTimer) -> ForwardTimer:
    """`timer` with its cache's layers put back on transformers' `DynamicLayer` (same entries)."""
    for i, layer in enumerate(timer.cache.layers):
        if type(layer) is GrowingLayer:
            plain = DynamicLayer()
            plain.lazy_initialization(layer.keys, layer.values)
            plain.keys, plain.values = layer.keys.contiguous(), layer.values.contiguous()
            timer.cache.layers[i] = plain
    return timer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m research.growing_cache", description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 2048], help="cached tokens")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 16], help="tree tokens verified")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)

    model, _ = load_model("packaged")
    drafter = hf_bpd.load_packaged_drafter()
    block = hf_bpd.prepare(drafter, model).linear_context
    rows = []
    with torch.no_grad(), block:
        for context in args.contexts:
            grown, concatenated = ForwardTimer(model, context), concatenating(ForwardTimer(model, context))
            timers = {"grown": grown, "concatenated": concatenated}
            assert type(timers["grown"].cache.layers[0]) is GrowingLayer
            for n in args.sizes:
                runs = {name: [] for name in timers}
                for name in timers:  # warm-up
                    timers[name].once(n, block)
                for r in range(args.repeats):
                    order = list(timers) if r % 2 == 0 else list(reversed(timers))
                    for name in order:
                        runs[name].append(timers[name].once(n, block))
                row = {"context": context, "tokens": n}
                row.update({f"{name}_ms": 1000 * statistics.median(t) for name, t in runs.items()})
                row["concatenated_over_grown"] = row["concatenated_ms"] / row["grown_ms"]
                rows.append(row)
                print(row, flush=True)
    report = {"environment": environment("cpu", "float32"), "args": vars(args), "rows": rows}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
