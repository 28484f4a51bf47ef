"""`hf-bpd demo`: decode a few prompts with the packaged SmolLM2 (its Q4_1 GGUF dequantised to float32),
plain `generate`, plain `generate` on `hf_bpd.fast_cpu`'s kernels (the ones hf_bpd's forwards use) and
hf_bpd with the shipped default drafter, and print block efficiency, tokens/s, the speedup over the faster
plain method and whether the outputs are identical.

Measured fairly: one-time work (dequantising the GGUF on first use, building the CPU kernel, the kernel
plan and the forward-cost curve `auto` trees are sized by: `hf_bpd.prepare`, logged as it runs;
warm-up runs of both methods) happens before any timing and is reported on its own line; the measurements
are cached per machine and model, so a second run skips them. Where other processes kept the machine busy
while timing, the demo says so instead of judging the methods. Every method is timed the same way:
each prompt runs `--repeats` rounds of all of them, in an order rotated from prompt to prompt, and each
method keeps its fastest round (load only ever slows a run, so the fastest is the steadiest estimate of
what the method costs). A prompt where hf_bpd is slower is said to be slower.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from importlib import resources

import torch

from ..cpu.packed_linear import fast_cpu
from ..decode.binding import prepare
from ..generation import generate as bpd_generate
from ..io.jsonl import parse_jsonl
from ..io.models import chat_inputs
from ..log import show_info
from ..machine_load import OtherLoad

WARMUP_PROMPT = "Say hello."


def demo_prompts() -> list[str]:
    text = resources.files("hf_bpd").joinpath("data/demo_prompts.jsonl").read_text(encoding="utf-8")
    return [row["prompt"] for row in parse_jsonl(text)]


def _timed(run) -> tuple[torch.Tensor, float]:
    t0 = time.perf_counter()
    with torch.no_grad():
        out = run()
    return out, time.perf_counter() - t0


@dataclass
class Kept:
    """A method's output on one prompt and its fastest round; `varied`: a later round decoded otherwise."""

    output: torch.Tensor
    seconds: float
    round: int
    varied: bool = False


def fastest_rounds(runs: dict, order: list[str], repeats: int, timed=_timed) -> dict[str, Kept]:
    """Per method of `runs` (name -> a call without arguments): its fastest of `repeats` rounds. Every round
    runs the methods in `order`, so a burst of load falls on all of them alike. Greedy decoding is
    deterministic, so a method whose output changes between rounds is marked `varied` (and is not identical
    to plain generate in at least one of them)."""
    kept: dict[str, Kept] = {}
    for round_ in range(repeats):
        for name in order:
            out, seconds = timed(runs[name])
            before = kept.get(name)
            if before is None or seconds < before.seconds:
                kept[name] = Kept(out, seconds, round_, before is not None and before.varied)
            if before is not None and not torch.equal(before.output, out):
                kept[name].varied = True
    return kept


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-bpd demo", description=__doc__)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--limit", type=int, default=None, help="number of demo prompts")
    parser.add_argument("--recalibrate", action="store_true", help="measure the forward-cost curve again")
    parser.add_argument("--repeats", type=int, default=2, help="rounds per prompt; each method keeps its fastest")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1 or (args.limit is not None and args.limit < 1) or args.repeats < 1:
        parser.error("--max-new-tokens, --limit and --repeats must be >= 1")

    from ..io.packaged import load_packaged_drafter, load_packaged_model

    show_info()  # one-time work says what it measures and how long it takes
    t0 = time.perf_counter()
    model, tokenizer = load_packaged_model()
    drafter = load_packaged_drafter()
    t_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    # what the first generate call would do: ahead of time
    setup = prepare(drafter, model, remeasure=args.recalibrate).setup
    fast_kernels = fast_cpu(model)  # the kernel plan prepare measured (once per machine, then cached)
    t_prepare = time.perf_counter() - t0
    if setup:
        how = "measured" if setup["measured"] else "read from the cache"
        calibration = f"forward-cost curve {how} ({setup['forward_cost_file']})"
    else:
        calibration = "fixed tree size, no forward-cost curve"

    def plain(inputs, n):
        return model.generate(**inputs, do_sample=False, max_new_tokens=n)

    def plain_fast(inputs, n):
        with fast_kernels:
            return plain(inputs, n)

    bpd_forwards: list[int] = []  # per hf_bpd run, so that a prompt's tau is its kept round's

    def bpd(inputs, n):
        out = model.generate(
            **inputs, do_sample=False, max_new_tokens=n, custom_generate=bpd_generate, assistant=drafter
        )
        bpd_forwards.append(drafter.stats.forwards)
        return out

    methods = {"plain": plain, "plain_fast": plain_fast, "hf_bpd": bpd}
    t0 = time.perf_counter()
    warm = chat_inputs(tokenizer, [{"role": "user", "content": WARMUP_PROMPT}])
    for run in methods.values():  # first calls pay one-time costs (packing the weights)
        _timed(lambda run=run: run(warm, 16))
    t_warm = time.perf_counter() - t0
    print(
        "SmolLM2-135M-Instruct (Q4_1 GGUF dequantised to float32) with the shipped heads "
        f"(h={drafter.num_heads}, top-k {drafter.top_k}, tree {drafter.max_tree_tokens}); greedy, "
        f"max_new_tokens={args.max_new_tokens}, {torch.get_num_threads()} CPU threads, "
        f"each method's fastest of {args.repeats} rounds per prompt\n"
        f"not timed: loading {t_load:.1f} s; one-time measurements {t_prepare:.1f} s ({calibration}; CPU kernels: "
        f"{fast_kernels.plan.description}); "
        f"warm-up of the methods {t_warm:.1f} s\n"
        "plain = model.generate; plain_fast = the same inside hf_bpd.fast_cpu(model) (the kernels hf_bpd uses); "
        "speedups divide by the faster of the two\n"
    )

    seconds = dict.fromkeys(methods, 0.0)
    tokens = forwards = 0
    all_same, slower = True, []
    with OtherLoad() as load:  # other processes' work while timing makes the timings unreliable
        for i, prompt in enumerate(demo_prompts()[: args.limit]):
            inputs = chat_inputs(tokenizer, [{"role": "user", "content": prompt}])
            n = inputs["input_ids"].shape[1]
            names = list(methods)
            names = names[i % 3 :] + names[: i % 3]  # rotate which method runs first
            runs = {
                name: (lambda run=run, inputs=inputs: run(inputs, args.max_new_tokens)) for name, run in methods.items()
            }
            bpd_forwards.clear()
            results = fastest_rounds(runs, names, args.repeats)
            ref, out = results["plain"].output, results["hf_bpd"].output
            same = not any(kept.varied for kept in results.values()) and all(
                torch.equal(results[m].output, ref) for m in ("plain_fast", "hf_bpd")
            )
            all_same &= same
            new = out.shape[1] - n
            for name in methods:
                seconds[name] += results[name].seconds
            kept_forwards = bpd_forwards[results["hf_bpd"].round]
            tokens += new
            forwards += kept_forwards
            ratio = min(results["plain"].seconds, results["plain_fast"].seconds) / results["hf_bpd"].seconds
            verdict = f"{ratio:.2f}x the faster plain" + (
                "" if ratio >= 1 else ", slower than plain generate on this prompt"
            )
            if ratio < 1:
                slower.append(i + 1)
            rates = " | ".join(f"{name} {new / results[name].seconds:.1f} tok/s" for name in methods)
            print(f"> {prompt}\n{tokenizer.decode(out[0, n:], skip_special_tokens=True).strip()}")
            print(f"  [{new} tokens | tau {new / kept_forwards:.2f} | {rates} | {verdict} | identical: {same}]\n")
    tau = tokens / max(forwards, 1)
    baseline = min(("plain", "plain_fast"), key=seconds.get)
    speedup = seconds[baseline] / seconds["hf_bpd"]
    rates = ", ".join(f"{name} {tokens / seconds[name]:.1f} tok/s" for name in methods)
    print(
        f"overall: tau {tau:.2f}, {rates}, speedup {speedup:.2f}x over {baseline} (the faster plain), "
        f"{seconds['plain'] / seconds['hf_bpd']:.2f}x over plain; all outputs identical: {all_same}"
    )
    if load.busy:
        print(
            f"The machine was busy while timing: other processes kept {load.cores:.1f} of {os.cpu_count()} cores "
            "busy, so these timings (and any slower verdict) are unreliable. Run `hf-bpd demo` again on an idle "
            "machine to compare the methods."
        )
    elif slower:
        print(
            f"hf_bpd was slower than the faster plain generate on prompt(s) {slower}: on a CPU a multi-token "
            "verification forward costs more than a one-token one, and where the drafts are rarely accepted that "
            "is lost."
        )
    if speedup < 1 and not load.busy:
        print("Overall hf_bpd was SLOWER than the faster plain generate on this machine.")
    return 0 if all_same else 1


if __name__ == "__main__":
    raise SystemExit(main())
