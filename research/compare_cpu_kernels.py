"""Which CPU kernels should plain decoding (and hf_bpd) run on? One process, one model, four ways:

    python -m research.compare_cpu_kernels --output benchmarks/kernels/smollm2.json

- eager: the model as loaded (BLAS through `F.linear`);
- packed: every linear on oneDNN's packed weights, at every row count (`PackedLinear` without a plan);
- fast_cpu: `hf_bpd.fast_cpu(model)`, the kernel plan measured on this machine (what hf_bpd ships);
- compiled: `torch.compile(model.forward, dynamic=True)` with inductor freezing (weights packed as
  constants), the other maintained option on torch 2.13.

For each: the forward time of 1-16 tokens on a 200-token cache (median), and plain greedy `generate` on
a few Spec-Bench dev prompts (tokens/s, and whether each output equals eager greedy's). The compiled
variant's first `generate` pays the compilation; its time is reported apart and not in its tokens/s.
Nothing else should run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import torch

from hf_bpd.cpu.packed_linear import PackedLinear, cached_kernel_plan, fast_cpu
from hf_bpd.decode.cost import ForwardTimer
from hf_bpd.io.jsonl import read_jsonl
from hf_bpd.io.models import chat_inputs, load_model
from hf_bpd.tools.bench import environment, select_rows
from research import SPEC_BENCH_DEV

SIZES = (1, 2, 4, 8, 16)


def forward_ms(model, block, repeats: int, context: int = 200) -> dict[int, float]:
    timer = ForwardTimer(model, context)
    with torch.no_grad():
        return {n: 1000 * timer.median(n, block, repeats) for n in SIZES}


def greedy_runs(model, block, prompts: list[dict], max_new_tokens: int) -> list[tuple[list[int], float]]:
    out = []
    for inputs in prompts:
        t0 = time.perf_counter()
        with block, torch.no_grad():
            seq = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
        out.append((seq[0].tolist(), time.perf_counter() - t0))
    return out


@contextlib.contextmanager
def compiled_forward(model):
    """`model.forward` compiled with inductor freezing for the block (an instance attribute, removed
    after; the compiled code stays in inductor's caches)."""
    import torch._inductor.config as inductor

    frozen = inductor.freezing
    inductor.freezing = True
    model.forward = torch.compile(model.forward, dynamic=True)
    try:
        yield
    finally:
        del model.forward
        inductor.freezing = frozen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m research.compare_cpu_kernels", description=__doc__.split("\n")[0])
    parser.add_argument("data", nargs="?", default=SPEC_BENCH_DEV)
    parser.add_argument("--model", default="packaged")
    parser.add_argument("--prompts", type=int, default=6, help="Spec-Bench rows, evenly spread over the file")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15, help="forwards per size and kernel (median)")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)

    env = environment("cpu", "float32")
    model, tokenizer = load_model(args.model)
    rows = select_rows(read_jsonl(args.data), None, None, None, spread=args.prompts)
    prompts = [chat_inputs(tokenizer, [{"role": "user", "content": r["turns"][0]}]) for r in rows]
    plan, _, _ = cached_kernel_plan(model)
    kernels = {
        "eager": contextlib.nullcontext(),
        "packed": PackedLinear(model),  # plan None: packed at every row count
        "fast_cpu": fast_cpu(model),
    }
    report = {"environment": env, "args": vars(args), "plan": plan.description, "kernels": {}}
    reference = None
    for name, block in kernels.items():
        greedy_runs(model, block, prompts[:1], 8)  # warm-up (packing)
        runs = greedy_runs(model, block, prompts, args.max_new_tokens)
        reference = reference or [seq for seq, _ in runs]
        report["kernels"][name] = _summary(runs, reference, prompts, forward_ms(model, block, args.repeats))
        print(name, report["kernels"][name], flush=True)
    kernels["packed"].clear()
    if not args.no_compile:
        with compiled_forward(model):
            t0 = time.perf_counter()
            greedy_runs(model, contextlib.nullcontext(), prompts[:1], 8)
            first = time.perf_counter() - t0
            runs = greedy_runs(model, contextlib.nullcontext(), prompts, args.max_new_tokens)  # may recompile
            warm = greedy_runs(model, contextlib.nullcontext(), prompts, args.max_new_tokens)
            summary = _summary(warm, reference, prompts, forward_ms(model, contextlib.nullcontext(), args.repeats))
        summary["first_call_seconds"] = first
        summary["first_pass_seconds"] = sum(s for _, s in runs)  # recompiles for new shapes land here
        report["kernels"]["compiled"] = summary
        print("compiled", summary, flush=True)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2))
    return 0


def _summary(runs, reference, prompts, forward: dict[int, float]) -> dict:
    tokens = sum(len(seq) - p["input_ids"].shape[1] for (seq, _), p in zip(runs, prompts))
    return {
        "forward_ms": forward,
        "greedy_tokens_per_s": tokens / sum(s for _, s in runs),
        "identical": sum(seq == ref for (seq, _), ref in zip(runs, reference)),
        "prompts": len(runs),
    }


if __name__ == "__main__":
    raise SystemExit(main())
