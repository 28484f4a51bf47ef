"""Memory over many `generate` calls with one drafter: RSS after every 50 calls, and the slope.

    python -m research.memory_soak --calls 1000 --output benchmarks/memory/soak_1000.json

A tiny random Llama (the drafter's state is what could grow: calibration, learned forward cost, recent
tree sizes, cached forward functions), greedy, 32 new tokens per call, prompts of 1-64 tokens. The slope
is fitted over the second half of the calls, after allocator warm-up.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m research.memory_soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--output")
    args = parser.parse_args(argv)
    from conftest import tiny_model

    import hf_bpd

    model = tiny_model("llama", eos_token_id=None)
    drafter = hf_bpd.BlockDrafter(hf_bpd.BlockDraftHeads.for_base_model(model, num_heads=3), top_k=3, max_tree_tokens=8)
    process, g = psutil.Process(), torch.Generator().manual_seed(0)
    points = []
    for call in range(1, args.calls + 1):
        ids = torch.randint(3, 97, (1, int(torch.randint(1, 65, (1,), generator=g))), generator=g)
        model.generate(ids, do_sample=False, max_new_tokens=32, custom_generate=hf_bpd.generate, assistant=drafter)
        if call % 50 == 0:
            points.append((call, process.memory_info().rss / 2**20))
    half = points[len(points) // 2 :]
    xs, ys = [p[0] for p in half], [p[1] for p in half]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    from hf_bpd.tools.bench import environment

    result = {
        "environment": environment("cpu", "float32"),
        "command": "python -m research.memory_soak " + " ".join(argv if argv is not None else sys.argv[1:]),
        "calls": args.calls,
        "rss_mib": points,
        "slope_kib_per_call_second_half": slope * 1024,
        "rss_growth_mib_second_half": ys[-1] - ys[0],
    }
    print(json.dumps({k: v for k, v in result.items() if k != "rss_mib"}, indent=1))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
