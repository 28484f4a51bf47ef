"""What a prefill pays for host memory: a batch's prefill forward asking for every layer's hidden state or the
last one alone (`compat.LAST_HIDDEN_STATE`), under glibc's default malloc or inside
`host_memory.reuse_freed_memory`, in one process:

    python -m research.prefill_memory --output benchmarks/kernels/prefill_memory_smollm2.json

For each batch size, the first turns of that many Spec-Bench dev rows (one per category, file order),
left-padded, prefilled as hf_bpd prefills (`call.prefill`'s inputs: the last position's logits) on
`fast_cpu`'s linears and grouped attention. The four variants alternate within each repeat, so drift hits
them alike; each forward's wall time and the minor page faults it took (`getrusage`) are recorded, medians
of `--repeats`. Plain `generate`'s prefill asks for no hidden state: the "last" variants are what hf_bpd's
prefill now costs beside it. Nothing else should run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import time
from pathlib import Path

import torch

from hf_bpd.compat import LAST_HIDDEN_STATE
from hf_bpd.cpu.grouped_attention import grouped_attention
from hf_bpd.cpu.host_memory import reuse_freed_memory
from hf_bpd.cpu.packed_linear import PackedLinear, cached_kernel_plan
from hf_bpd.io.jsonl import read_jsonl
from hf_bpd.io.models import load_model
from hf_bpd.tools.bench import environment, left_padded_batch, select_rows
from research import SPEC_BENCH_DEV

HIDDEN = {"every": True, "last": LAST_HIDDEN_STATE}
MALLOC = {"default": contextlib.nullcontext, "reuse_freed": reuse_freed_memory}


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def measure(model, tokenizer, prompts: list[str], repeats: int) -> dict:
    inputs = left_padded_batch(tokenizer, prompts, "cpu")
    linears = PackedLinear(model, plan=cached_kernel_plan(model)[0])  # fast_cpu's kernels, malloc apart
    variants = [(h, m) for h in HIDDEN for m in MALLOC]
    seconds = {v: [] for v in variants}
    faults = {v: [] for v in variants}
    with torch.no_grad(), linears, grouped_attention(model):
        for repeat in range(repeats + 1):  # the first repeat warms up (packs the weights)
            for hidden, malloc in variants if repeat % 2 == 0 else reversed(variants):
                with MALLOC[malloc]():
                    before, t0 = minor_faults(), time.perf_counter()
                    out = model(**inputs, use_cache=True, logits_to_keep=1, output_hidden_states=HIDDEN[hidden])
                    elapsed, faulted = time.perf_counter() - t0, minor_faults() - before
                    del out
                if repeat:
                    seconds[(hidden, malloc)].append(elapsed)
                    faults[(hidden, malloc)].append(faulted)
    return {
        "rows": len(prompts),
        "slots": int(inputs["input_ids"].shape[1]),
        "variants": [
            {
                "hidden_states": hidden,
                "malloc": malloc,
                "median_s": statistics.median(seconds[(hidden, malloc)]),
                "seconds": seconds[(hidden, malloc)],
                "median_minor_faults": statistics.median(faults[(hidden, malloc)]),
            }
            for hidden, malloc in variants
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m research.prefill_memory", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="packaged")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 13])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--data", default=SPEC_BENCH_DEV)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    model, tokenizer = load_model(args.model)
    prompts = [row["turns"][0] for row in select_rows(list(read_jsonl(args.data)), None, 1, None)]
    results = []
    for size in args.batch_sizes:
        result = measure(model, tokenizer, prompts[:size], args.repeats)
        print(json.dumps(result), flush=True)
        results.append(result)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    report = {"environment": environment("cpu", "float32"), "args": vars(args), "results": results}
    Path(args.output).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
