"""Where a batch's time goes: plain batched greedy (on `hf_bpd.fast_cpu`'s kernels) against hf_bpd, forward by
forward, on one batch of the benchmark's prompts.

Every forward of the base model is timed by hooks (prefill, one-token steps, tree verifications, kept apart
by their number of new tokens per row); what is left of the call's wall time is the loop's own work (heads,
trees, accepting, cache compaction, logits processors, stopping criteria). Run with nothing else on the
machine:

    python -m research.batch_step_profile --per-category 1 --batch-size 13 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch

import hf_bpd
from hf_bpd.cpu.packed_linear import fast_cpu
from hf_bpd.io.jsonl import read_jsonl
from hf_bpd.io.models import load_model
from hf_bpd.io.packaged import load_packaged_drafter
from hf_bpd.tools.bench import left_padded_batch, select_rows
from research import SPEC_BENCH_DEV


class ForwardClock:
    """Times every forward of `model` by the number of tokens each row feeds it (1: a plain step)."""

    def __init__(self, model):
        self.model = model
        self.by_width: dict[int, list[float]] = defaultdict(list)
        self._start = 0.0

    def __enter__(self):
        self._hooks = [
            self.model.register_forward_pre_hook(self._before, with_kwargs=True),
            self.model.register_forward_hook(self._after, with_kwargs=True),
        ]
        return self

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()

    def _before(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self._width = int(ids.shape[1]) if ids is not None else -1
        self._start = time.perf_counter()

    def _after(self, module, args, kwargs, output):
        self.by_width[self._width].append(time.perf_counter() - self._start)


def profile(name: str, run, model) -> dict:
    with ForwardClock(model) as clock:
        t0 = time.perf_counter()
        out = run()
        wall = time.perf_counter() - t0
    widths = sorted(clock.by_width)
    prefill = max(widths)
    forwards = {w: clock.by_width[w] for w in widths if w != prefill}
    forward_time = sum(sum(v) for v in clock.by_width.values())
    return {
        "method": name,
        "wall_s": round(wall, 3),
        "prefill_s": round(sum(clock.by_width[prefill]), 3),
        "decode_forwards": {
            str(w): {"n": len(v), "total_s": round(sum(v), 3), "mean_ms": round(1000 * sum(v) / len(v), 1)}
            for w, v in forwards.items()
        },
        "outside_forwards_s": round(wall - forward_time, 3),
        "generated_columns": int(out.shape[1]),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=SPEC_BENCH_DEV)
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=13)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)

    model, tokenizer = load_model(None)
    rows = select_rows(list(read_jsonl(args.data)), None, args.per_category, None)
    batch = left_padded_batch(tokenizer, [r["turns"][0] for r in rows[: args.batch_size]], model.device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    inputs = {**batch, "pad_token_id": pad, "do_sample": False, "max_new_tokens": args.max_new_tokens}
    drafter = load_packaged_drafter()
    hf_bpd.prepare(drafter, model)
    kernels = fast_cpu(model)

    def plain():
        with kernels:
            return model.generate(**inputs)

    def bpd():
        return model.generate(**inputs, custom_generate=hf_bpd.generate, assistant=drafter)

    with torch.no_grad():
        reference = plain()  # warm-up, and the reference
        same = bpd().tolist() == reference.tolist()
        for _ in range(args.repeats):
            for name, run in (("greedy_fast", plain), ("hf_bpd", bpd)):
                result = profile(name, run, model)
                if name == "hf_bpd":
                    result["plain_steps"] = drafter.stats.plain_steps
                    result["steps"] = drafter.stats.steps
                    result["stats_per_step_s"] = {k: round(v, 4) for k, v in drafter.stats.time_per_step().items()}
                print(json.dumps(result), flush=True)
    print(json.dumps({"identical": same, "rows": len(batch["input_ids"]), "width": batch["input_ids"].shape[1]}))


if __name__ == "__main__":
    main()
