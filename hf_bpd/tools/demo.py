"""`hf-bpd demo`: decode a few prompts with the packaged SmolLM2 (its Q4_1 GGUF dequantised to float32),
plain `generate` vs hf_bpd with the shipped default drafter, and print block efficiency, tokens/s and
whether the outputs are identical.

Measured fairly: one-time work (dequantising the GGUF on first use, the forward-cost curve `auto` trees
are sized by, warm-up runs of both methods) happens before any timing and is reported on its own line;
the curve is cached per machine and model, so a second run skips it. Both methods are timed the same way,
in alternating order from prompt to prompt, and a prompt where hf_bpd is slower is said to be slower.
"""

from __future__ import annotations

import argparse
import time
from importlib import resources

import torch

from ..generation import generate as bpd_generate
from ..jsonl import parse_jsonl
from ..models import chat_inputs

WARMUP_PROMPT = "Say hello."


def demo_prompts() -> list[str]:
    text = resources.files("hf_bpd").joinpath("data/demo_prompts.jsonl").read_text(encoding="utf-8")
    return [row["prompt"] for row in parse_jsonl(text)]


def _timed(run) -> tuple[torch.Tensor, float]:
    t0 = time.perf_counter()
    with torch.no_grad():
        out = run()
    return out, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-bpd demo", description=__doc__)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--limit", type=int, default=None, help="number of demo prompts")
    parser.add_argument("--recalibrate", action="store_true", help="measure the forward-cost curve again")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1 or (args.limit is not None and args.limit < 1):
        parser.error("--max-new-tokens and --limit must be >= 1")

    from ..cost import cached_forward_cost
    from ..packaged import load_packaged_drafter, load_packaged_model

    t0 = time.perf_counter()
    model, tokenizer = load_packaged_model()
    drafter = load_packaged_drafter()
    t_load = time.perf_counter() - t0
    if drafter.max_tree_tokens == "auto":
        t0 = time.perf_counter()
        drafter.forward_cost, cost_file, measured = cached_forward_cost(
            model, packed_linear=drafter.packed_linear, refresh=args.recalibrate
        )
        how = f"measured in {time.perf_counter() - t0:.1f} s" if measured else "read from the cache"
        calibration = f"forward-cost curve {how} ({cost_file})"
    else:
        calibration = "fixed tree size, no forward-cost curve"

    def plain(inputs, n):
        return model.generate(**inputs, do_sample=False, max_new_tokens=n)

    def fast(inputs, n):
        return model.generate(
            **inputs, do_sample=False, max_new_tokens=n, custom_generate=bpd_generate, assistant=drafter
        )

    t0 = time.perf_counter()
    warm = chat_inputs(tokenizer, [{"role": "user", "content": WARMUP_PROMPT}])
    for run in (plain, fast):  # first calls pay one-time costs (kernel selection, packing the weights)
        _timed(lambda run=run: run(warm, 16))
    t_warm = time.perf_counter() - t0
    print(
        "SmolLM2-135M-Instruct (Q4_1 GGUF dequantised to float32) with the shipped heads "
        f"(h={drafter.num_heads}, top-k {drafter.top_k}, tree {drafter.max_tree_tokens}); greedy, "
        f"max_new_tokens={args.max_new_tokens}, {torch.get_num_threads()} CPU threads\n"
        f"not timed: loading {t_load:.1f} s; {calibration}; warm-up of both methods {t_warm:.1f} s\n"
    )

    totals = {"plain_s": 0.0, "bpd_s": 0.0, "tokens": 0, "forwards": 0}
    all_same, slower = True, []
    for i, prompt in enumerate(demo_prompts()[: args.limit]):
        inputs = chat_inputs(tokenizer, [{"role": "user", "content": prompt}])
        n = inputs["input_ids"].shape[1]
        order = [("plain", plain), ("hf_bpd", fast)]
        results = {}
        for name, run in order if i % 2 == 0 else order[::-1]:  # alternate which method runs first
            results[name] = _timed(lambda run=run, inputs=inputs: run(inputs, args.max_new_tokens))
        (ref, t_plain), (out, t_bpd) = results["plain"], results["hf_bpd"]
        same = ref[0].tolist() == out[0].tolist()
        all_same &= same
        new = out.shape[1] - n
        s = drafter.stats
        totals["plain_s"] += t_plain
        totals["bpd_s"] += t_bpd
        totals["tokens"] += new
        totals["forwards"] += s.forwards
        ratio = t_plain / t_bpd
        verdict = f"{ratio:.2f}x plain" + ("" if ratio >= 1 else ", SLOWER than plain generate on this prompt")
        if ratio < 1:
            slower.append(i + 1)
        print(f"> {prompt}\n{tokenizer.decode(out[0, n:], skip_special_tokens=True).strip()}")
        print(
            f"  [{new} tokens | tau {s.block_efficiency:.2f} | plain {new / t_plain:.1f} tok/s | "
            f"hf_bpd {new / t_bpd:.1f} tok/s | {verdict} | identical: {same}]\n"
        )
    tau = totals["tokens"] / max(totals["forwards"], 1)
    speedup = totals["plain_s"] / totals["bpd_s"]
    print(
        f"overall: tau {tau:.2f}, plain {totals['tokens'] / totals['plain_s']:.1f} tok/s, "
        f"hf_bpd {totals['tokens'] / totals['bpd_s']:.1f} tok/s, speedup {speedup:.2f}x, "
        f"all outputs identical: {all_same}"
    )
    if slower:
        print(
            f"hf_bpd was slower than plain generate on prompt(s) {slower}: on a CPU a multi-token verification "
            "forward costs more than a one-token one, and where the drafts are rarely accepted that is lost."
        )
    if speedup < 1:
        print("Overall hf_bpd was SLOWER than plain generate on this machine.")
    return 0 if all_same else 1


if __name__ == "__main__":
    raise SystemExit(main())
