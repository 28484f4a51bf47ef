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
identical to plain greedy.

`--variants` names the copies (default: the three rules above). Besides the rules, a copy may bound how large
its "auto" trees grow (`growth8`: the heads grow at most 8 nodes a step, sized up to the curve's largest) or
are verified (`cap8`: sized up to 8 nodes; `cap8_no_chooser`: the same, every step drafted), to tell apart
where a bound's gain comes from; `whole_tree_growth` bounds the heads' growth by the whole sized trees, the rule
before `assembly.grown_nodes` (a looked-up chain's nodes counted too); `probe4` probes drafting after 4 plain
steps, waiting at most 8 (what one row does since claim probe4_spread40_amd, `cost.ROW_PROBES`; the rows' waits
before it, 8 doubling to 32, are a batch's, `cost.BATCH_PROBES`, so `expected` runs those again only in a
checkout from before that change):

    python -m research.step_chooser ../shared/data/spec_bench_dev.jsonl --spread 40 --sessions 1 --passes 2 \
        --max-new-tokens 128 --variants expected no_chooser growth8 cap8 cap8_no_chooser \
        --output benchmarks/sizing/sizing_parts_spread40_amd.json"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import hf_bpd
from hf_bpd.decode import binding
from hf_bpd.decode.cost import measure_forward_cost
from hf_bpd.drafting import drafter as drafter_module
from hf_bpd.drafting.drafter import BlockDrafter
from hf_bpd.io.jsonl import read_jsonl
from hf_bpd.io.models import chat_inputs
from hf_bpd.io.packaged import load_packaged_drafter, load_packaged_model
from hf_bpd.tools.bench import select_rows
from hf_bpd.tools.bench.report import environment
from hf_bpd.tools.demo import WARMUP_PROMPT, demo_prompts

CHOOSERS = ("expected", "realized", "no_chooser")
# each copy's departures from the shipped drafter: no step chooser, the realized rule, a bound on growth or size
VARIANTS = {
    "expected": {},
    "realized": {"realized": True},
    "no_chooser": {"no_chooser": True},
    "growth8": {"growth": 8},
    "cap8": {"cap": 8},
    "cap8_no_chooser": {"cap": 8, "no_chooser": True},
    "whole_tree_growth": {"whole_tree_growth": True},
    "probe4": {"probe": (4, 8)},
}


def judged_as(setting: dict):
    """Patches that make the drafters run as the copy named `setting["chooser"]` says (`VARIANTS`)."""
    expected_tokens, step_chooser = BlockDrafter.expected_tokens, binding.ModelBinding.step_chooser
    tree_budget, growth_budget = BlockDrafter.tree_budget.fget, drafter_module.growth_budget

    def variant() -> dict:
        return VARIANTS.get(setting["chooser"], {})

    BlockDrafter.expected_tokens = lambda self: None if variant().get("realized") else expected_tokens(self)

    def chooser(self, *args, **kwargs):
        if variant().get("no_chooser"):
            return None
        chosen = step_chooser(self, *args, **kwargs)
        if chosen is not None and "probe" in variant():
            chosen.probe_every, chosen.max_probe_every = variant()["probe"]
        return chosen

    binding.ModelBinding.step_chooser = chooser
    BlockDrafter.tree_budget = property(lambda self: min(tree_budget(self), variant().get("cap", tree_budget(self))))

    def bounded_growth(budget, *args, **kwargs):
        return min(growth_budget(budget, *args, **kwargs), variant().get("growth", budget))

    drafter_module.growth_budget = bounded_growth
    size_trees = drafter_module.size_trees

    def sized_by_whole_trees(trees, *args, **kwargs):  # the rule before: a whole sized tree bounds the next growth
        cut, grown = size_trees(trees, *args, **kwargs)
        if variant().get("whole_tree_growth"):
            grown = [len(tree) for tree, drafted in zip(cut, trees) if len(drafted) > 1]
        return cut, grown

    drafter_module.size_trees = sized_by_whole_trees


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
        steps = sum(r.get("steps", 0) for r in mine)
        phases = {}
        if steps:  # runs that recorded their phases (a drafter's)
            phases = {
                "mean_tree_tokens": sum(r["tree_tokens"] for r in mine) / steps,
                "heads_ms_per_step": 1000 * sum(r["heads_seconds"] for r in mine) / steps,
                "verify_ms_per_step": 1000 * sum(r["verify_seconds"] for r in mine) / steps,
                "ms_per_step": 1000 * whole["seconds"] / steps,
            }
        summary[name] = {
            **phases,
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
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(CHOOSERS), help="the drafter copies")
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
    methods = ("plain_fast", *args.variants)
    runs, curves = [], []
    for session in range(args.sessions):
        drafters = {name: load_packaged_drafter() for name in args.variants}
        first = drafters[args.variants[0]]
        hf_bpd.prepare(first, model)  # the kernel plan, read from the cache
        curve = measure_forward_cost(model, packed_linear=first.packed_linear)  # a fresh process's
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
                    if stats:  # where a drafted step's time went, and the trees' sizes
                        runs[-1].update(
                            steps=stats.steps,
                            tree_tokens=sum(stats.tree_sizes),
                            heads_seconds=stats.time_heads,
                            verify_seconds=stats.time_verify,
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
