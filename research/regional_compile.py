"""Regional compilation as a cheaper stand-in for compiling the whole forward: does it pay on this CPU?

    python -m research.regional_compile --output benchmarks/speed/regional_compile_amd.json

Why: the shipped default's tree forwards run eager (packed linears), and eager spends a share of every
forward on thousands of small ops that a compiled graph fuses; compiling the whole forward fixes that but
costs minutes per process. PyTorch's documented cure for compile time is regional compilation (compile
the repeated decoder layer once and reuse it for every layer: `nn.Module.compile` on each layer, or
accelerate's `compile_regions`). This measures it on the packaged model, without touching its modeling
file:
- `packed_eager`: the decoder as hf_bpd runs it today (`fast_cpu`: packed linears by the kernel plan);
- `regional`: every decoder layer compiled (`dynamic=True`), its linears on packed weights through an
  opaque custom op (inductor cannot lower oneDNN's packed op with the weight as a graph input), the LM
  head packed outside the layers;
- `regional_grouped`: the same with hf_bpd's grouped attention inside the compiled layers.
For each: the forward of n tokens on a 256-token cache (`cost.ForwardTimer`, the call verification makes),
the compilation time, the graphs dynamo compiled, how often its recompile limit sent a function to eager,
and the largest logit difference against packed eager on a 40-token prompt. Run with nothing else on the
machine.
"""

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Optional
from unittest import mock

import torch
import torch._dynamo as dynamo

import hf_bpd.cpu.grouped_attention as grouped_module
from hf_bpd.cpu.grouped_attention import grouped_attention
from hf_bpd.cpu.packed_linear import PACK_ROWS, PackedLinear, fast_cpu
from hf_bpd.decode.cost import ForwardTimer
from hf_bpd.io.models import load_model
from hf_bpd.tools.bench import environment


# torch.library reads the schema from these annotations at run time (so no `from __future__ import annotations`)
@torch.library.custom_op("hf_bpd_research::packed_linear", mutates_args=())
def packed_linear_op(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: Optional[torch.Tensor],  # noqa: UP045
    out_features: int,
) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], out_features)


@packed_linear_op.register_fake
def _(x, packed, bias, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


class LimitWarnings(logging.Handler):
    """Counts dynamo's "hit config.recompile_limit" warnings: past it a function runs eagerly."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += "recompile_limit" in record.getMessage()


def forward_ms(timer: ForwardTimer, block, sizes, repeats: int) -> dict[int, float]:
    return {n: 1000 * timer.median(n, block, repeats) for n in sizes}


def measure_regional(model, timer: ForwardTimer, head: PackedLinear, probe, reference, args) -> dict:
    """Compile (from a reset dynamo) and time the regionally compiled decoder as it stands."""
    dynamo.reset()
    dynamo.utils.counters.clear()
    limit_hits = LimitWarnings()
    logging.getLogger("torch._dynamo").addHandler(limit_hits)
    t0 = time.perf_counter()
    for n in (1, 8, 3, 1, 8):  # a one-token and two tree shapes, twice: every graph the timing meets
        timer.once(n, head)
    compile_seconds = time.perf_counter() - t0
    logging.getLogger("torch._dynamo").removeHandler(limit_hits)
    stats = dynamo.utils.counters["stats"]
    regional = {
        "compile_seconds": compile_seconds,
        "graphs": int(stats["unique_graphs"]),
        "frames": int(stats["calls_captured"]),
        "recompile_limit": dynamo.config.recompile_limit,
        "recompile_limit_hits": limit_hits.count,  # functions dynamo gave up on and ran eagerly
        "forward_ms": forward_ms(timer, head, args.sizes, args.repeats),
    }
    with head:
        logits = model(input_ids=probe).logits
    regional["max_logit_difference"] = float((logits - reference).abs().max())
    regional["same_argmax"] = bool((logits.argmax(-1) == reference.argmax(-1)).all())
    return regional


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m research.regional_compile", description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)

    model, _ = load_model("packaged")
    report = {"environment": environment("cpu", "float32"), "args": vars(args)}
    probe = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    with fast_cpu(model):
        reference = model(input_ids=probe).logits
    timer = ForwardTimer(model, 256)
    report["packed_eager"] = {"forward_ms": forward_ms(timer, fast_cpu(model), args.sizes, args.repeats)}
    print("packed_eager", report["packed_eager"], flush=True)

    linears = [m for m in model.model.layers.modules() if type(m) is torch.nn.Linear]
    for layer in linears:  # a buffer, so dynamo lifts it as an input of the one graph all layers share
        packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight, PACK_ROWS)
        layer.register_buffer("packed", packed, persistent=False)
        layer.forward = lambda x, layer=layer: packed_linear_op(x, layer.packed, layer.bias, layer.out_features)
    head = PackedLinear(model.lm_head)
    for decoder_layer in model.model.layers:
        decoder_layer.compile(dynamic=True)
    report["regional"] = measure_regional(model, timer, head, probe, reference, args)
    print("regional", report["regional"], flush=True)
    # the same with hf_bpd's grouped attention inside the compiled layers (it steps aside under dynamo in the
    # library, where a whole compiled forward keeps transformers' layout): a masked forward of several
    # tokens then attends on the cached key/value heads instead of copying them per query head
    with grouped_attention(model), mock.patch.object(grouped_module, "is_torchdynamo_compiling", lambda: False):
        report["regional_grouped"] = measure_regional(model, timer, head, probe, reference, args)
    print("regional_grouped", report["regional_grouped"], flush=True)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
