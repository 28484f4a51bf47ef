"""The streamed linear kernel against the kernels it joined (BLAS, oneDNN's packed weights), on this CPU:

    python -m research.streamed_kernel --output benchmarks/kernels/streamed_smollm2_amd.json

Why: at the few rows of decoding, BLAS and oneDNN ran the packaged model's linears at about twice the time
one read of their weights takes here (`research.step_profile`: 64 ms of linears in a one-token forward, 92
ms in an 8-token one), so tree forwards cost far more than one-token ones. `hf_bpd.cpu.streamed_linear` streams
each weight once per 12 rows with the arithmetic overlapped. This measures, in one process:
- `linears`: every linear weight of the model in turn (as a forward runs them, so they stream from
  memory), on each kernel alone, by row count, and the time to read every weight once (`sum`): the floor;
- `forward`: the verification forward of n tokens on a 256-token cache (`cost.ForwardTimer`, the call
  decoding makes) under two kernel plans measured here, one without the streamed kernel (the plan before
  it existed) and one with it (today's), interleaved so that drift hits both alike;
- the plans themselves, and the largest difference of their logits on one 8-token forward;
- with `--previous REV`: the kernel's source at git revision REV built beside today's (with
  `--previous-flags`, default today's build flags; each build packs its own panels), as one more kernel in
  `linears` and as today's plan run on it in `forward` (interleaved too): what an edit of the kernel or of
  its build changed, and whether its outputs stayed the same bits.
Run with nothing else on the machine; no claim rests on one run of it alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

from hf_bpd.cpu import streamed_linear
from hf_bpd.cpu.packed_linear import PACK_ROWS, PackedLinear, measure_kernel_plan
from hf_bpd.decode.cost import ForwardTimer
from hf_bpd.io.models import load_model
from hf_bpd.tools.bench import environment


def previous_kernel(rev: str, flags: list[str] | None = None):
    """The streamed kernel's source at git revision `rev`, built as its own extension module (with `flags`;
    None: today's build flags)."""
    source = subprocess.run(
        ["git", "show", f"{rev}:hf_bpd/cpu/csrc/streamed_linear.cpp"], check=True, capture_output=True, text=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "streamed_linear_previous.cpp"
    path.write_text(source)
    return streamed_linear.build(path, [flags] if flags else None)


class OnKernel:
    """A `PackedLinear` block whose streamed linears run on another build of the kernel while inside it."""

    def __init__(self, block: PackedLinear, module) -> None:
        self.block, self.module = block, module

    def __enter__(self):
        self.patch = mock.patch.object(streamed_linear, "_module", lambda: self.module)
        self.patch.start()
        return self.block.__enter__()

    def __exit__(self, *exc) -> None:
        self.block.__exit__(*exc)
        self.patch.stop()


def linear_passes(model, sizes: list[int], repeats: int, previous=None) -> dict:
    """Median ms to run every linear weight of `model` once on n rows, per kernel and n; `read_ms`: one
    `sum` over every weight (the memory floor). `previous`: another build of the streamed kernel, timed as
    "streamed_previous" (and checked to give the same bits)."""
    weights = [m.weight.detach() for m in model.modules() if type(m) is torch.nn.Linear]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS) for w in weights]
    panels = [streamed_linear.pack(w) for w in weights]
    kernels = {
        "blas": lambda x, i: F.linear(x, weights[i]),
        "onednn": lambda x, i: torch.ops.mkldnn._linear_pointwise(x, onednn[i], None, "none", [], ""),
        "streamed": lambda x, i: streamed_linear.linear(x, panels[i], weights[i].shape[0]),
    }
    if previous is not None:
        previous_panels = [previous.pack(w) for w in weights]
        kernels["streamed_previous"] = lambda x, i: previous.linear(x, previous_panels[i], weights[i].shape[0])
    g = torch.Generator().manual_seed(0)
    out = {"weights_mb": sum(w.numel() * 4 for w in weights) / 1e6, "ms": {}}
    for n in sizes:
        xs = {k: torch.randn(n, k, generator=g) for k in {w.shape[1] for w in weights}}
        times = {k: [] for k in kernels}
        for _ in range(repeats + 1):
            for name, kernel in kernels.items():
                t0 = time.perf_counter()
                for i, w in enumerate(weights):
                    kernel(xs[w.shape[1]], i)
                times[name].append(time.perf_counter() - t0)
        out["ms"][n] = {k: statistics.median(v[1:]) * 1000 for k, v in times.items()}
        if previous is not None:
            out.setdefault("same_bits_as_previous", {})[n] = all(
                torch.equal(kernels["streamed"](xs[w.shape[1]], i), kernels["streamed_previous"](xs[w.shape[1]], i))
                for i, w in enumerate(weights)
            )
        print(n, out["ms"][n], flush=True)
    reads = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        for w in weights:
            w.sum()
        reads.append(time.perf_counter() - t0)
    out["read_ms"] = statistics.median(reads[1:]) * 1000
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="packaged")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--previous", help="a git revision whose streamed kernel to time beside today's")
    parser.add_argument("--previous-flags", help='compiler flags for the previous build, e.g. "-O3 -mavx2 -mfma"')
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    if not streamed_linear.available():
        raise SystemExit(f"the streamed kernel is unavailable here: {streamed_linear.unavailable_reason()}")
    env = environment("cpu", "float32")
    torch.set_grad_enabled(False)
    model, _ = load_model(args.model, dtype="float32", device="cpu")
    report = {"environment": env, "args": {k: str(v) for k, v in vars(args).items()}}
    previous = previous_kernel(args.previous, (args.previous_flags or "").split() or None) if args.previous else None
    report["builds"] = {"streamed": streamed_linear.build_info()}
    if previous is not None and hasattr(previous, "build_info"):
        report["builds"]["streamed_previous"] = dict(previous.build_info())
    report["linears"] = linear_passes(model, args.sizes, args.repeats, previous)
    with_streamed = measure_kernel_plan(model)
    with mock.patch.object(streamed_linear, "available", lambda: False):
        without = measure_kernel_plan(model)
    report["plans"] = {"without_streamed": without.description, "with_streamed": with_streamed.description}
    blocks = {
        "without_streamed": PackedLinear(model, plan=without, grouped_attention_of=model),
        "with_streamed": PackedLinear(model, plan=with_streamed, grouped_attention_of=model),
    }
    if previous is not None:  # today's plan with the streamed linears on the previous kernel
        blocks["with_streamed_previous"] = OnKernel(
            PackedLinear(model, plan=with_streamed, grouped_attention_of=model), previous
        )
    timer = ForwardTimer(model, args.context)
    report["forward_ms"] = {}
    for n in args.sizes:
        times = {k: [] for k in blocks}
        for _ in range(args.repeats + 1):
            for name, block in blocks.items():
                times[name].append(timer.once(n, block))
        report["forward_ms"][n] = {k: statistics.median(v[1:]) * 1000 for k, v in times.items()}
        print(n, report["forward_ms"][n], flush=True)
    ids = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1))
    logits = {}
    for name, block in blocks.items():
        with block:
            logits[name] = model(input_ids=ids).logits
    report["max_logit_difference"] = float((logits["with_streamed"] - logits["without_streamed"]).abs().max())
    report["same_argmax"] = bool(torch.equal(logits["with_streamed"].argmax(-1), logits["without_streamed"].argmax(-1)))
    if previous is not None:
        report["same_logits_as_previous"] = bool(torch.equal(logits["with_streamed"], logits["with_streamed_previous"]))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
