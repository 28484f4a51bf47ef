"""Choose the shipped drafter settings (number of heads, top-k, tree size) by measurement.

Tuning prompts are prompts of the training prompt file that were NOT distilled (so neither the heads'
training data nor the Spec-Bench evaluation data): the settings must generalise, not fit the benchmark.
Each configuration decodes every tuning prompt with hf_bpd (through `hf_bpd.tools.bench.run_bench`, with greedy
as the lossless reference); reported: τ, tokens/s, speedup (same process, same
prompts, configurations interleaved per prompt), and the best by tokens/s is written to `drafter.json`.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

from hf_bpd.drafting.drafter import BlockDrafter
from hf_bpd.drafting.heads import BlockDraftHeads
from hf_bpd.tools.bench import bpd_method, greedy_method, run_bench
from hf_bpd.training.distill import DEFAULT_PROMPTS, load_distilled, load_prompts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m research.tune_drafter", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="packaged")
    parser.add_argument("--heads", required=True)
    parser.add_argument("--distilled", required=True, help="distilled dataset folder: its prompt ids are excluded")
    parser.add_argument("--prompts", default=DEFAULT_PROMPTS)
    parser.add_argument("--num-prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--num-heads", type=int, nargs="+", default=None)
    parser.add_argument("--top-k", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--tree", nargs="+", default=["auto", "16"], help="max_tree_tokens values ('auto' or int)")
    parser.add_argument("--output", default=None, help="drafter.json to write with the best settings")
    args = parser.parse_args(argv)

    from hf_bpd.decode.cost import measure_forward_cost
    from hf_bpd.io.models import load_model

    model, tokenizer = load_model(args.model)
    heads = BlockDraftHeads.from_pretrained(args.heads).bind(model)
    used = set(load_distilled(args.distilled)["id"])
    prompts = [p for i, p in load_prompts(args.prompts, "prompt", "id", None, seed=1) if i not in used]
    prompts = prompts[: args.num_prompts]
    cost = measure_forward_cost(model)  # packed_linear "auto", as the drafters below
    print("forward cost (ms):", {n: round(1000 * t, 1) for n, t in zip(cost.sizes, cost.seconds)})
    methods = [greedy_method(model)]
    settings = {}
    for h, k, tree in itertools.product(args.num_heads or [heads.num_heads], args.top_k, args.tree):
        tree_arg = "auto" if tree == "auto" else int(tree)
        drafter = BlockDrafter(
            heads.first_heads(h), top_k=k, max_tree_tokens=tree_arg, forward_cost=cost if tree == "auto" else None
        )
        name = f"h{h}-k{k}-{tree}"
        settings[name] = {"num_heads": h, "top_k": k, "max_tree_tokens": tree_arg}
        methods.append(bpd_method(model, drafter, name))
    # the bench's interleaved, forward-counted measurement, with greedy as the lossless reference
    rows = [{"category": "tuning", "turns": [p]} for p in prompts]
    results = run_bench(model, tokenizer, rows, methods, args.max_new_tokens)
    rows = []
    for name, config in settings.items():
        s = results[name]["overall"]
        if not s["identical"]:
            raise SystemExit(f"{name} differs from greedy: not lossless")
        rows.append({**config, "tau": s["tau"], "tokens_per_s": s["tokens_per_s"], "speedup": s["speedup"]})
        print(json.dumps(rows[-1]))
    best = max(rows, key=lambda r: r["tokens_per_s"])
    print("best:", json.dumps(best))
    if args.output:
        Path(args.output).write_text(
            json.dumps({k: best[k] for k in ("num_heads", "top_k", "max_tree_tokens")}, indent=2) + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
