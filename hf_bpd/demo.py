"""`hf-bpd demo`: decode a few prompts with the packaged SmolLM2, plain `generate` vs hf_bpd, and print
block efficiency, tokens/s and whether the outputs are identical."""

from __future__ import annotations

import argparse
import time
from importlib import resources

import torch

from .decoding import generate as bpd_generate
from .jsonl import parse_jsonl
from .models import chat_inputs


def demo_prompts() -> list[str]:
    text = resources.files("hf_bpd").joinpath("data/demo_prompts.jsonl").read_text(encoding="utf-8")
    return [row["prompt"] for row in parse_jsonl(text)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-bpd demo", description=__doc__)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--limit", type=int, default=None, help="number of demo prompts")
    args = parser.parse_args(argv)

    from .packaged import load_packaged_drafter, load_packaged_model

    model, tokenizer = load_packaged_model()
    drafter = load_packaged_drafter()
    print(
        f"SmolLM2-135M-Instruct with the shipped heads (h={drafter.num_heads}, top-k {drafter.top_k}, "
        f"tree {drafter.max_tree_tokens}); greedy, max_new_tokens={args.max_new_tokens}\n"
    )
    totals = {"plain_s": 0.0, "bpd_s": 0.0, "tokens": 0, "forwards": 0}
    all_same = True
    for prompt in demo_prompts()[: args.limit]:
        inputs = chat_inputs(tokenizer, [{"role": "user", "content": prompt}])
        n = inputs["input_ids"].shape[1]
        with torch.no_grad():
            t0 = time.perf_counter()
            plain = model.generate(**inputs, do_sample=False, max_new_tokens=args.max_new_tokens)
            t1 = time.perf_counter()
            fast = model.generate(
                **inputs,
                do_sample=False,
                max_new_tokens=args.max_new_tokens,
                custom_generate=bpd_generate,
                assistant=drafter,
            )
            t2 = time.perf_counter()
        same = plain[0].tolist() == fast[0].tolist()
        all_same &= same
        new = fast.shape[1] - n
        s = drafter.stats
        totals["plain_s"] += t1 - t0
        totals["bpd_s"] += t2 - t1
        totals["tokens"] += new
        totals["forwards"] += s.forwards
        print(f"> {prompt}\n{tokenizer.decode(fast[0, n:], skip_special_tokens=True).strip()}")
        print(
            f"  [{new} tokens | tau {s.block_efficiency:.2f} | plain {new / (t1 - t0):.1f} tok/s | "
            f"hf_bpd {new / (t2 - t1):.1f} tok/s | identical: {same}]\n"
        )
    tau = totals["tokens"] / max(totals["forwards"], 1)
    print(
        f"overall: tau {tau:.2f}, plain {totals['tokens'] / totals['plain_s']:.1f} tok/s, "
        f"hf_bpd {totals['tokens'] / totals['bpd_s']:.1f} tok/s, speedup {totals['plain_s'] / totals['bpd_s']:.2f}x, "
        f"all outputs identical: {all_same}"
    )
    return 0 if all_same else 1


if __name__ == "__main__":
    raise SystemExit(main())
