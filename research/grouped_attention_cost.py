"""What `grouped_attention` saves: a verification forward's time by tree width, with transformers' `sdpa`
(the cache's keys and values copied once per query head for every masked forward of several tokens)
and with `hf_bpd.cpu.grouped_attention` (the query heads folded onto the cached heads), in one process:

    python -m research.grouped_attention_cost --output benchmarks/kernels/grouped_attention_smollm2.json

For each batch size, the first turns of that many Spec-Bench dev rows (one per category, file order),
left-padded and prefilled once; then forwards of every row's root plus a chain of w - 1 drafted tokens
(w = 1, 2, 4, 8), verified as hf_bpd verifies a tree (4D mask, position ids), the cache cropped back after
each. Both variants run on `fast_cpu`'s linears and alternate within each repeat, so drift hits them
alike; medians of `--repeats`. The largest logit difference between the two variants is recorded: only
the kernel's rounding may differ. Nothing else should run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch

from hf_bpd.cpu.grouped_attention import grouped_attention
from hf_bpd.cpu.packed_linear import PackedLinear, cached_kernel_plan
from hf_bpd.decode.call import prefill, prompt_mask
from hf_bpd.decode.verify import verify_tree
from hf_bpd.drafting.tree import DraftTree, batch_trees
from hf_bpd.io.jsonl import read_jsonl
from hf_bpd.io.models import load_model
from hf_bpd.tools.bench import environment, left_padded_batch, select_rows
from research import SPEC_BENCH_DEV

WIDTHS = (1, 2, 4, 8)


def chains(roots: torch.Tensor, width: int):
    """Every row's root and a chain of `width - 1` drafted tokens (any tokens: only the time matters)."""
    trees = []
    for root in roots.tolist():
        tree = DraftTree.root_only(root)
        tree.add_path([(root + 1 + i) % 1000 for i in range(width - 1)], width)
        trees.append(tree)
    return batch_trees(trees, pad_token_id=0, device=roots.device)


def measure(model, tokenizer, prompts: list[str], repeats: int) -> dict:
    inputs = left_padded_batch(tokenizer, prompts, "cpu")
    linears = PackedLinear(model, plan=cached_kernel_plan(model)[0])  # fast_cpu's kernels, attention apart
    variants = {"sdpa": contextlib.nullcontext, "grouped_attention": lambda: grouped_attention(model)}
    with torch.no_grad(), linears:
        kwargs = {"attention_mask": inputs["attention_mask"], "use_cache": True}
        past_mask = prompt_mask(inputs["input_ids"], kwargs)
        logits, _, cache = prefill(model, inputs["input_ids"], kwargs)
        length = cache.get_seq_length()
        roots = logits.argmax(-1)
        times = {name: {w: [] for w in WIDTHS} for name in variants}
        differences = {w: 0.0 for w in WIDTHS}
        for width in WIDTHS:
            batch = chains(roots, width)
            for repeat in range(repeats + 1):
                outputs = {}
                for name in variants if repeat % 2 == 0 else reversed(variants):
                    with variants[name]():
                        t0 = time.perf_counter()
                        outputs[name] = verify_tree(model, batch, cache, past_mask).logits
                        seconds = time.perf_counter() - t0
                    cache.crop(length - cache.get_seq_length())
                    if repeat:  # the first repeat warms up
                        times[name][width].append(seconds)
                difference = (outputs["sdpa"] - outputs["grouped_attention"]).abs().max().item()
                differences[width] = max(differences[width], difference)
    return {
        "rows": len(prompts),
        "cache_slots": length,
        "forward_ms": {name: {w: 1000 * statistics.median(t) for w, t in by.items()} for name, by in times.items()},
        "max_logit_difference": differences,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m research.grouped_attention_cost", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model", default="packaged")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 13])
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--data", default=SPEC_BENCH_DEV)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer = load_model(args.model)
    rows = select_rows(list(read_jsonl(args.data)), None, 1, None)
    prompts = [row["turns"][0] for row in rows]
    report = {"environment": environment("cpu", "float32"), "args": vars(args), "batches": {}}
    for batch_size in args.batch_sizes:
        report["batches"][str(batch_size)] = result = measure(model, tokenizer, prompts[:batch_size], args.repeats)
        print(batch_size, json.dumps(result["forward_ms"]), flush=True)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
