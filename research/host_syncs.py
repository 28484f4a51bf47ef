"""Device-to-host synchronisations per decoding step of the shipped drafter, by phase, greedy and sampled:

    python -m research.host_syncs --output benchmarks/syncs/smollm2.json

Counted on a CPU with `BlockDrafter.count_host_syncs` (`hf_bpd/decode/syncs.py`): the same calls that would make
a GPU's host wait. Sampling twice: as the shipped drafter runs it on a CPU (the host walk, one read per
reached node) and with the device walk it takes on an accelerator (`BlockDrafter.fused_sampling`). One
Spec-Bench dev prompt per category (first turns), untimed (counting slows every torch call). Outputs are
checked against plain `generate` (greedy; seeded sampling).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import torch

import hf_bpd
from hf_bpd.io.jsonl import read_jsonl
from hf_bpd.io.models import chat_inputs, load_model
from hf_bpd.tools.bench import environment, select_rows
from research import SPEC_BENCH_DEV

# name -> (generate's decoding arguments, the drafter's `fused_sampling`: None is the shipped "auto", which
# on a CPU walks sampled steps on the host; True takes the device walk an accelerator gets, `sampled_walk.py`)
SETTINGS = {
    "greedy": ({"do_sample": False}, None),
    "sampling T=0.7 top-p 0.9": ({"do_sample": True, "temperature": 0.7, "top_p": 0.9}, None),
    "sampling T=0.7 top-p 0.9, device walk": ({"do_sample": True, "temperature": 0.7, "top_p": 0.9}, True),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m research.host_syncs", description=__doc__.split("\n")[0])
    parser.add_argument("data", nargs="?", default=SPEC_BENCH_DEV)
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)

    env = environment("cpu", "float32")
    model, tokenizer = load_model("packaged")
    rows = select_rows(read_jsonl(args.data), None, args.per_category, None)
    report = {"environment": env, "args": vars(args), "settings": {}}
    for name, (decoding, fused_sampling) in SETTINGS.items():
        drafter = hf_bpd.load_packaged_drafter()
        drafter.count_host_syncs = True
        drafter.fused_sampling = fused_sampling
        counts, steps, identical = Counter(), 0, 0
        for i, row in enumerate(rows):
            inputs = chat_inputs(tokenizer, [{"role": "user", "content": row["turns"][0]}])
            torch.manual_seed(i)
            ref = model.generate(**inputs, **decoding, max_new_tokens=args.max_new_tokens)
            torch.manual_seed(i)
            out = model.generate(
                **inputs,
                **decoding,
                max_new_tokens=args.max_new_tokens,
                custom_generate=hf_bpd.generate,
                assistant=drafter,
            )
            identical += out.tolist() == ref.tolist()
            counts.update({k: v for k, v in drafter.stats.host_syncs.items() if k != "prefill"})
            steps += drafter.stats.steps
        per_step = {k: v / steps for k, v in sorted(counts.items())}
        report["settings"][name] = {
            "per_step": per_step,
            "total_per_step": sum(per_step.values()),
            "steps": steps,
            "prompts": len(rows),
            "identical": identical,
        }
        print(name, report["settings"][name], flush=True)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
