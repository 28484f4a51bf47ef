"""Whether a verification forward compiled around the kernel plan pays on this CPU, and what it costs a
process to compile:

    python -m research.compiled_plan_forward --output benchmarks/kernels/compiled_plan_forward_smollm2_intel.json

The shipped default runs its forwards eagerly on the kernel plan (`hf_bpd.fast_cpu`: the streamed kernel,
oneDNN or BLAS per shape and row count). On a 2-core CPU about half of an 8-token forward is not the
linears but thousands of small ops (norms, rotary embeddings, attention bookkeeping, Python between them),
which `torch.compile` fuses. The bench's compiled forward (`--methods ..._compiled`) uses inductor's
freezing, whose oneDNN linears lose to the streamed kernel at 2-16 rows, and whose graphs no on-disk cache
keeps (claim compile_cache_amd). Here `model.forward` is compiled (dynamic shapes, no freezing) inside the
kernel plan's block, so the plan's kernels run in the graph as custom ops (`PackedLinear.pack_planned`)
and inductor fuses the rest; the weights stay graph inputs, so inductor's and AOTAutograd's on-disk
caches may serve a second process.

`--processes` fresh processes run one after another on one new inductor cache folder (the first cold,
the next warm), each: the compile time of the forwards decoding makes (the prefill of a `--context`-token
prompt, then 1, 2, 4, 8 and 16 tokens on its cache), then the forward of n tokens eager against compiled,
in turns, median of `--repeats` (`cost.ForwardTimer`, decoding's own call), and the largest logit
difference between the two on one prompt. Run with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SIZES = (1, 2, 4, 8, 16)


def one_process(context: int, repeats: int) -> dict:
    import torch._dynamo.config as dynamo

    import hf_bpd
    from hf_bpd.decode.cost import ForwardTimer
    from hf_bpd.io.models import load_model

    model, _ = load_model("packaged")
    packed = hf_bpd.fast_cpu(model)
    dynamo.recompile_limit = max(dynamo.recompile_limit, 64)
    compiled = torch.compile(model.forward, dynamic=True)

    @contextlib.contextmanager
    def compiled_forward():
        model.forward = compiled  # an instance attribute, as transformers documents compiling a forward
        try:
            yield
        finally:
            del model.forward

    result = {}
    with torch.no_grad(), packed:
        packed.pack_planned()
        prompt = torch.randint(0, 49152, (1, 64), generator=torch.Generator().manual_seed(1))
        eager_logits = model(input_ids=prompt).logits
        t0 = time.perf_counter()
        with compiled_forward():
            compiled_logits = model(input_ids=prompt).logits
            timer = {"compiled": ForwardTimer(model, context)}  # its prefill: a graph of many rows
            first = {n: timer["compiled"].once(n, contextlib.nullcontext()) for n in SIZES}
        result["compile_seconds"] = time.perf_counter() - t0
        result["first_call_seconds"] = first
        result["largest_logit_difference"] = float((eager_logits - compiled_logits).abs().max())
        result["same_argmax"] = bool(torch.equal(eager_logits.argmax(-1), compiled_logits.argmax(-1)))
        timer["eager"] = ForwardTimer(model, context)
        blocks = {"compiled": compiled_forward, "eager": contextlib.nullcontext}
        forward_ms = {name: {} for name in timer}
        for n in SIZES:
            runs = {name: [] for name in timer}
            for name in timer:
                timer[name].once(n, blocks[name]())
            for r in range(repeats):
                for name in list(timer) if r % 2 == 0 else list(reversed(timer)):
                    runs[name].append(timer[name].once(n, blocks[name]()))
            for name in timer:
                forward_ms[name][n] = 1000 * statistics.median(runs[name])
            print(n, {name: round(forward_ms[name][n], 1) for name in timer}, flush=True)
        result["forward_ms"] = forward_ms
    return result


def main(argv: list[str] | None = None) -> int:
    description = __doc__.split("\n")[0]
    parser = argparse.ArgumentParser(prog="python -m research.compiled_plan_forward", description=description)
    parser.add_argument("--context", type=int, default=256, help="cached tokens")
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--output", required=True)
    parser.add_argument("--child", help=argparse.SUPPRESS)  # where a child process writes its result
    args = parser.parse_args(argv)
    if args.child:
        Path(args.child).write_text(json.dumps(one_process(args.context, args.repeats)))
        return 0

    from hf_bpd.tools.bench import environment

    processes = []
    with tempfile.TemporaryDirectory() as folder:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(Path(folder) / "inductor")}
        for i in range(args.processes):
            child = Path(folder) / f"process{i}.json"
            t0 = time.perf_counter()
            command = [sys.executable, "-m", "research.compiled_plan_forward", "--output", args.output]
            command += ["--context", str(args.context), "--repeats", str(args.repeats), "--child", str(child)]
            subprocess.run(command, env=env, check=True)
            result = json.loads(child.read_text())
            result["process_seconds"] = time.perf_counter() - t0
            result["inductor_cache"] = "cold (empty folder)" if i == 0 else "warm (the processes before wrote it)"
            processes.append(result)
            print(i, {k: v for k, v in result.items() if k != "forward_ms"}, flush=True)
    report = {"environment": environment("cpu", "float32"), "args": vars(args), "processes": processes}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
