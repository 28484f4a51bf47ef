"""How the step chooser judges drafted steps, on the demo's prompts (a new user's first contact):

    python -m research.step_chooser --sessions 3 --output benchmarks/speed/step_chooser_demo_amd.json
    python -m research.step_chooser ../shared/data/spec_bench_dev.jsonl --spread 40 --sessions 1 --passes 1 \
        --max-new-tokens 128 --output benchmarks/speed/step_chooser_spread40_amd.json

`hf-bpd demo` run fresh three times gave 1.29x, 1.13x and 1.00x the faster plain generate, τ 1.63 to 1.30,
with identical outputs: the "auto" policy took a few to most of a prompt's steps plain, run to run. Here
each session measures a fresh forward-cost curve (as a fresh process does) and hands it to three copies of
the shipped drafter, which differ only in how `cost.StepChooser` judges a drafted step: by its trees'
expected tokens (`expected`, shipped), by the tokens it happened to add (`realized`, the rule before), or
not at all, every step drafted (`no_chooser`). Plain greedy on `fast_cpu`'s kernels (the faster plain
method on this CPU) runs beside them; the four methods run in rotating order per prompt, each prompt twice
per session. `--temperature` (and `--top-p`) samples, every call seeded alike, so that hf_bpd's tokens are
plain sampling's. With a data file, its rows' first turns stand for the demo's prompts (`--spread`: that many rows
spread over its categories, as `hf-bpd bench` picks them). Run it on an idle machine; outputs are checked
identical to plain greedy."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import hf_bpd
from hf_bpd.decode import binding
from hf_bpd.decode.cost import measure_forward_cost
from hf_bpd.drafting.drafter import BlockDrafter
from hf_bpd.io.jsonl import read_jsonl
from hf_bpd.io.models import chat_inputs
from hf_bpd.io.packaged import load_packaged_drafter, load_packaged_model
from hf_bpd.tools.bench import select_rows
from hf_bpd.tools.bench.report import environment
from hf_bpd.tools.demo import WARMUP_PROMPT, demo_prompts

CHOOSERS = ("expected", "realized", "no_chooser")


def judged_as(setting: dict):
    """Patches that make the drafters run as `setting["chooser"]` says (see the module docstring)."""
    expected_tokens, step_chooser = BlockDrafter.expected_tokens, binding.ModelBinding.step_chooser
    BlockDrafter.expected_tokens = lambda self: None if setting["chooser"] == "realized" else expected_tokens(self)
    binding.ModelBinding.step_chooser = lambda self, *args, **kwargs: (
        None if setting["chooser"] == "no_chooser" else step_chooser(self, *args, **kwargs)
    )


def totals(rows) -> dict:
    """Tokens, forwards, seconds and plain steps summed over `rows`."""
    keys = ("tokens", "forwards", "seconds", "plain_steps")
    sums = dict.fromkeys(keys, 0)
    for row in rows:
        for key in keys:
            sums[key] += row[key]
    return sums


def summarise(runs: list[dict], methods) -> dict:
    """Per method: its tokens/s, τ and speed over plain_fast, over all runs and by pass, and its identical runs."""
    plain_seconds = totals(r for r in runs if r["method"] == "plain_fast")["seconds"]
    summary = {}
    for name in methods:
        mine = [r for r in runs if r["method"] == name]
        passes = sorted({(r["session"], r["pass"]) for r in mine})
        per_pass = []
        for key in passes:
            mine_here = totals(r for r in mine if (r["session"], r["pass"]) == key)
            plain_here = totals(r for r in runs if r["method"] == "plain_fast" and (r["session"], r["pass"]) == key)
            per_pass.append(
                {
                    "session": key[0],
                    "pass": key[1],
                    "tau": mine_here["tokens"] / mine_here["forwards"],
                    "x_plain_fast": plain_here["seconds"] / mine_here["seconds"],
                    "plain_steps": mine_here["plain_steps"],
                }
            )
        whole = totals(mine)
        summary[name] = {
            "tokens_per_second": whole["tokens"] / whole["seconds"],
            "tau": whole["tokens"] / whole["forwards"],
            "per_pass": per_pass,
            "identical": sum(r["identical"] for r in mine),
            "runs": len(mine),
            "x_plain_fast": plain_seconds / whole["seconds"],
        }
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m research.step_chooser", description=__doc__.split("\n")[0])
    parser.add_argument("data", nargs="?", default=None, help="a Spec-Bench-style JSONL (default: the demo's prompts)")
    parser.add_argument("--spread", type=int, default=None, help="rows spread over the data's categories")
    parser.add_argument("--sessions", type=int, default=3)
    parser.add_argument("--passes", type=int, default=2, help="passes over the prompts per session")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=None, help="sample at this temperature (default: greedy)")
    parser.add_argument("--top-p", type=float, default=None, help="with --temperature: nucleus sampling")
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)

    if args.top_p is not None and args.temperature is None:
        parser.error("--top-p samples: give --temperature too")
    env = environment("cpu", "float32")
    decoding = {"do_sample": False}
    if args.temperature is not None:  # each call seeded alike: hf_bpd then draws plain sampling's very tokens
        decoding = {"do_sample": True, "temperature": args.temperature, "top_k": None}
        decoding.update({} if args.top_p is None else {"top_p": args.top_p})
    setting = {"chooser": None}
    judged_as(setting)
    model, tokenizer = load_packaged_model()
    if args.data is None:
        prompts = demo_prompts()
    else:
        prompts = [row["turns"][0] for row in select_rows(read_jsonl(args.data), None, None, None, args.spread)]
    fast = hf_bpd.fast_cpu(model)
    methods = ("plain_fast", *CHOOSERS)
    runs, curves = [], []
    for session in range(args.sessions):
        drafters = {name: load_packaged_drafter() for name in CHOOSERS}
        hf_bpd.prepare(drafters["expected"], model)  # the kernel plan, read from the cache
        curve = measure_forward_cost(model, packed_linear=drafters["expected"].packed_linear)  # a fresh process's
        curves.append([round(s, 6) for s in curve.seconds])
        for drafter in drafters.values():
            drafter.forward_cost = curve
            hf_bpd.prepare(drafter, model)

        def run(name, inputs, n, drafters=drafters):
            setting["chooser"] = name
            torch.manual_seed(0)
            if name == "plain_fast":
                with fast:
                    return model.generate(**inputs, **decoding, max_new_tokens=n)
            kwargs = {"custom_generate": hf_bpd.generate, "assistant": drafters[name]}
            return model.generate(**inputs, **decoding, max_new_tokens=n, **kwargs)

        warm = chat_inputs(tokenizer, [{"role": "user", "content": WARMUP_PROMPT}])
        for name in methods:
            run(name, warm, 16)
        for rep in range(args.passes):
            for i, prompt in enumerate(prompts):
                inputs = chat_inputs(tokenizer, [{"role": "user", "content": prompt}])
                start = (i + rep) % len(methods)
                outputs = {}
                for name in methods[start:] + methods[:start]:
                    t0 = time.perf_counter()
                    outputs[name] = run(name, inputs, args.max_new_tokens)
                    seconds = time.perf_counter() - t0
                    stats = drafters[name].stats if name in drafters else None
                    new = outputs[name].shape[1] - inputs["input_ids"].shape[1]
                    runs.append(
                        {
                            "session": session,
                            "pass": rep,
                            "prompt": i,
                            "method": name,
                            "tokens": new,
                            "forwards": stats.forwards if stats else new,
                            "plain_steps": stats.plain_steps if stats else new,
                            "seconds": seconds,
                        }
                    )
                reference = outputs["plain_fast"][0].tolist()
                for row in runs[-len(methods) :]:
                    row["identical"] = outputs[row["method"]][0].tolist() == reference
                print(
                    session,
                    rep,
                    i,
                    {r["method"]: round(r["tokens"] / r["seconds"], 1) for r in runs[-len(methods) :]},
                    flush=True,
                )

    summary = summarise(runs, methods)
    report = {
        "environment": env,
        "args": vars(args),
        "forward_cost_sizes": list(curve.sizes),
        "forward_cost_seconds": curves,
        "summary": summary,
        "runs": runs,
    }
    Path(args.output).write_text(json.dumps(report, indent=1) + "\n")
    for name, s in summary.items():
        print(name, f"tau {s['tau']:.2f}, {s['tokens_per_second']:.1f} tok/s, {s['x_plain_fast']:.2f}x plain_fast")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
