"""What one decoding step of the shipped default is made of, op by op, on this CPU:

    python -m research.step_profile --output benchmarks/speed/step_profile_amd.json

- the heads' tree growth (`BlockDrafter.grow`, trees grown on the device, read by the host) at the growth
  budgets decoding uses, each timed after a one-token forward of the base model (as in decoding, whose
  forward streams ~540 MB and evicts the heads' weights from the CPU's caches): with the process's
  intra-op threads, with one thread (tiny ops pay a thread barrier each), and with the heads' linears and
  their softmax layer on int8 weights (`aten._weight_int8pack_mm`, one scale per output row; patched here
  for the measurement only: drafts would change, never an output);
- the verification forward of n tree tokens (`cost.ForwardTimer`: the very call decoding makes) on the
  drafter's kernels (packed linears by the measured plan), n = 1, 2, 4, 8, 16;
- for one growth and for the 1- and 8-token forwards, `torch.profiler`'s op table: how many ops run, and
  how their time splits between linear layers (`aten::linear`, `mkldnn::_linear_pointwise`, `aten::addmm`,
  `aten::mm`), attention (`scaled_dot_product_attention` and hf_bpd's grouped attention) and all the
  rest (norms, rotary embeddings, copies, Python between ops).
Untimed work and noise: run with nothing else on the machine. No claim rests on one run of this; it says
where the next lever is.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import hf_bpd
from hf_bpd.decode.cost import ForwardTimer
from hf_bpd.io.models import load_model
from hf_bpd.tools.bench import environment

LINEAR_OPS = ("aten::linear", "mkldnn::_linear_pointwise", "aten::addmm", "aten::mm", "aten::matmul")
ATTENTION_OPS = ("aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention_for_cpu")


def op_split(prof) -> dict:
    """Self CPU time of a profile, split into linear layers, attention and the rest; and its op count."""
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    linear = sum(e.self_cpu_time_total for e in events if e.key in LINEAR_OPS)
    attention = sum(e.self_cpu_time_total for e in events if e.key in ATTENTION_OPS or "attention" in e.key)
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    return {
        "ops": sum(e.count for e in events),
        "self_ms": total / 1000,
        "linear_ms": linear / 1000,
        "attention_ms": attention / 1000,
        "rest_ms": (total - linear - attention) / 1000,
        "top": [{"op": e.key, "count": e.count, "self_ms": e.self_cpu_time_total / 1000} for e in top],
    }


def timed(fn, repeats: int, before=None) -> float:
    """Median seconds of `fn()` over `repeats` runs after a warm-up, `before()` (untimed) ahead of each."""
    fn()
    runs = []
    for _ in range(repeats):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 weights with one float32 scale per output row."""
    scales = weight.abs().amax(dim=1).clamp_min(1e-12) / 127
    return torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous(), scales.float()


@contextlib.contextmanager
def int8_heads(drafter):
    """The drafter's heads' residual linears and their softmax layer (the borrowed LM-head rows) on int8
    weights, in place of their packed kernels (`BlockDrafter.heads_context`, set aside meanwhile)."""
    heads, kernels = drafter.heads, drafter.heads_context
    drafter.heads_context = contextlib.nullcontext()
    saved = []
    for layer in (m for m in heads.modules() if type(m) is torch.nn.Linear):
        w8, scales = int8_rows(layer.weight.detach())
        bias = layer.bias

        def forward(x, w8=w8, scales=scales, bias=bias):
            rows = x.reshape(-1, x.shape[-1])
            out = torch.ops.aten._weight_int8pack_mm(rows, w8, scales)
            out = out if bias is None else out + bias
            return out.reshape(*x.shape[:-1], w8.shape[0])

        layer.__dict__["forward"] = forward
        saved.append(layer)
    w8, scales = int8_rows(heads.__dict__["_tied_weight"].detach())
    heads.__dict__["project"] = lambda states: torch.ops.aten._weight_int8pack_mm(
        states.reshape(-1, states.shape[-1]), w8, scales
    ).reshape(*states.shape[:-1], w8.shape[0])
    try:
        yield
    finally:
        for layer in saved:
            layer.__dict__.pop("forward", None)
        heads.__dict__.pop("project", None)
        drafter.heads_context = kernels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m research.step_profile", description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=256, help="cached tokens before the step")
    parser.add_argument("--budgets", type=int, nargs="+", default=[4, 8, 12, 16], help="nodes grown")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="tree tokens verified")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)

    model, _ = load_model("packaged")
    drafter = hf_bpd.load_packaged_drafter()
    linear_context = hf_bpd.prepare(drafter, model).linear_context
    threads = torch.get_num_threads()
    report = {"environment": environment("cpu", "float32"), "args": vars(args), "threads": threads}
    timer = ForwardTimer(model, args.context)
    with torch.no_grad(), linear_context:
        # the hidden state a step drafts from: the last position of the timer's random context
        out = model(input_ids=torch.tensor([[1, 2, 3]]), output_hidden_states=True)
        hidden, root = out.hidden_states[-1][:, -1], out.logits[:, -1].argmax(-1)
        growth = {}

        def evict():
            timer.once(1, linear_context)

        for budget in args.budgets:
            row = {}
            step = lambda b=budget: drafter.grow(hidden, root, b).flat().tolist()  # noqa: E731 (one read, as decoding's)
            for n in sorted({threads, 1}, reverse=True):
                torch.set_num_threads(n)
                row[f"ms_{n}_threads"] = 1000 * timed(step, args.repeats, evict)
            torch.set_num_threads(threads)
            row["ms_no_eviction"] = 1000 * timed(step, args.repeats)
            with int8_heads(drafter):
                row["ms_int8"] = 1000 * timed(step, args.repeats, evict)
                row["int8_same_tree"] = drafter.grow(hidden, root, budget).flat().tolist()
            row["int8_same_tree"] = row["int8_same_tree"] == drafter.grow(hidden, root, budget).flat().tolist()
            growth[budget] = row
            print("grow", budget, row, flush=True)
        report["growth"] = growth
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            drafter.grow(hidden, root, max(args.budgets)).flat().tolist()
        report["growth_ops"] = op_split(prof)
        print("growth ops", {k: v for k, v in report["growth_ops"].items() if k != "top"}, flush=True)

        forwards = {}
        for n in args.sizes:
            forwards[n] = 1000 * timer.median(n, linear_context, args.repeats)
            print("verify", n, f"{forwards[n]:.1f} ms", flush=True)
        report["verify_ms"] = forwards
        report["verify_ops"] = {}
        for n in (1, 8):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                timer.once(n, linear_context)
            report["verify_ops"][n] = op_split(prof)
            print("verify ops", n, {k: v for k, v in report["verify_ops"][n].items() if k != "top"}, flush=True)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
