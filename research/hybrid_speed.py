"""τ and tokens/s of hf_bpd on a hybrid model (linear attention + full attention, Qwen3-Next style), against
plain greedy `generate` as loaded and inside `hf_bpd.fast_cpu` (the fastest plain decoding on a CPU here,
short of a torch.compile run), on a tiny-but-not-trivial random-weight config on the CPU:

    python -m research.hybrid_speed --output benchmarks/hybrid/qwen3_next_cpu.json

hf_bpd runs two drafters on the same prompts: zero-residual heads (they draft the base model's own next token
from the last hidden state; untrained, so τ comes mostly from context lookup on the random model's repetitive
text) and an oracle that drafts plain greedy's true continuation with one draft token in two made wrong at
a random depth (chains cut short and restored, as trained heads see them, so the replay's cost shows). Each
run checks its output equals plain greedy's; times are medians of `--repeats` runs after a warm-up, with
`torch.set_num_threads(--threads)`. Nothing else should run on the machine meanwhile. `--smoke` checks the
script runs without measuring anything machine-wide (no kernel plan, no forward-cost curve: plain kernels,
fixed trees of 8, one repeat); its numbers are not a measurement.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

import hf_bpd
from hf_bpd import BlockDrafter, BlockDraftHeads, ScoredPath

CONFIG = dict(
    vocab_size=4096,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=8,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=256,
    shared_expert_intermediate_size=256,
    max_position_embeddings=4096,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def build_model(seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model("qwen3_next", **CONFIG)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()
    with torch.no_grad():  # sharper distributions: a random model's greedy choices far from ties
        model.lm_head.weight.mul_(4.0)
    return model


class WrongHalfTheTime(BlockDrafter):
    """Drafts plain greedy's true continuation (`reference`), one token made wrong in half the chains."""

    def __init__(self, model, reference: list[int], depth: int = 6, seed: int = 0):
        super().__init__(
            BlockDraftHeads.for_base_model(model, num_heads=4),
            top_k=2,
            max_tree_tokens=depth + 1,
            rescorer=self._truth,
            packed_linear=False,
        )
        self.reference, self.depth, self.rng = reference, depth, random.Random(seed)

    def _truth(self, lattice, context):
        truth = self.reference[context.shape[1] : context.shape[1] + self.depth]
        if truth and self.rng.random() < 0.5:
            truth[self.rng.randrange(len(truth))] = 3 + (truth[0] + 1) % 1000
        return [[ScoredPath(tuple(truth), 0.0)] if truth else []]


def timed(fn, repeats: int) -> tuple[float, object]:
    fn()  # warm-up
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m research.hybrid_speed", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--output", default="benchmarks/hybrid/qwen3_next_cpu.json")
    parser.add_argument("--smoke", action="store_true", help="check the script runs (see the docstring)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.smoke:
        args.repeats = 1
    from hf_bpd.tools.bench import environment

    env = environment("cpu", "float32")
    model = build_model()
    g = torch.Generator().manual_seed(0)
    # prompts that repeat a phrase, as chat and code contexts do, so context lookup has something to copy
    prompts = []
    for _ in range(args.prompts):
        phrase = torch.randint(3, CONFIG["vocab_size"], (args.prompt_len // 4,), generator=g)
        prompts.append(
            torch.cat([phrase, torch.randint(3, 4096, (args.prompt_len // 4,), generator=g), phrase] * 2)[None]
        )
    kw = dict(do_sample=False, max_new_tokens=args.max_new_tokens, eos_token_id=None, pad_token_id=0)
    rows = []
    for i, ids in enumerate(prompts):
        with torch.no_grad():
            plain_s, ref = timed(lambda ids=ids: model.generate(ids, **kw), args.repeats)
            if args.smoke:  # the kernel plan is measured at first use: not in a smoke run
                fast_s, fast = plain_s, ref
            else:
                with hf_bpd.fast_cpu(model):
                    fast_s, fast = timed(lambda ids=ids: model.generate(ids, **kw), args.repeats)
            new = ref.shape[1] - ids.shape[1]
            row = {"prompt": i, "new_tokens": new, "greedy_tok_s": new / plain_s, "greedy_fast_tok_s": new / fast_s}
            row["greedy_fast_identical"] = fast.tolist() == ref.tolist()
            drafters = {
                "hf_bpd_copying_heads": BlockDrafter(
                    BlockDraftHeads.for_base_model(model, num_heads=4),
                    top_k=4,
                    max_tree_tokens=8 if args.smoke else "auto",
                    packed_linear=False if args.smoke else None,
                ),
                "hf_bpd_oracle_wrong_half": WrongHalfTheTime(model, ref[0].tolist()),
            }
            for name, drafter in drafters.items():
                seconds, out = timed(
                    lambda d=drafter, ids=ids: model.generate(ids, custom_generate=hf_bpd.generate, assistant=d, **kw),
                    args.repeats,
                )
                row[f"{name}_tok_s"] = new / seconds
                row[f"{name}_tau"] = drafter.stats.block_efficiency
                row[f"{name}_replayed_per_step"] = drafter.stats.replayed / max(drafter.stats.steps, 1)
                row[f"{name}_identical"] = out.tolist() == ref.tolist()
        rows.append(row)
        print(json.dumps(row), flush=True)
    fastest = [max(r["greedy_tok_s"], r["greedy_fast_tok_s"]) for r in rows]
    summary = {"fastest_plain_tok_s": statistics.mean(fastest)}
    for name in ("hf_bpd_copying_heads", "hf_bpd_oracle_wrong_half"):
        summary[f"{name}_tau"] = statistics.mean(r[f"{name}_tau"] for r in rows)
        summary[f"{name}_speedup"] = statistics.mean(r[f"{name}_tok_s"] / f for r, f in zip(rows, fastest))
        summary[f"{name}_identical"] = all(r[f"{name}_identical"] for r in rows)
    result = {
        "command": "python -m research.hybrid_speed " + " ".join(argv if argv is not None else sys.argv[1:]),
        "environment": env,
        "config": {"model_type": "qwen3_next", **CONFIG},
        "settings": vars(args),
        "summary": summary,
        "rows": rows,
    }
    print(json.dumps(summary, indent=1))
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
