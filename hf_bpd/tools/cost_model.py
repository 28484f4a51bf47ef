"""`hf-bpd cost-model`: what blockwise decoding can gain on a device, before any heads are trained for it.

Forward and drafting times do not depend on the weights, so they are measured on Llama-shaped models with
random weights (nothing to download): for each tree size n, the verification forward t(n) on a cache of
`--context` tokens (`cost.measure_forward_cost`, run the way decoding runs it) and the drafter's own work
d(n) per step (shipped-style heads: h = 5 heads reading the drafted token, an 8,192-token draft
vocabulary, top-k 10, context lookup). With τ(n) from a replay of real heads (`hf-bpd replay
--limit-table --output F`, passed as `--replay F`) it projects the speedup over plain greedy decoding:

    speedup(n) = τ(n) · t(1) / (t(n) + d(n))

(greedy pays t(1) per token; a step of hf_bpd pays one tree forward and one draft, and yields τ(n)
tokens). τ measured on one model is an assumption for another: the projection says what the device's
cost curve allows, not what a given model's heads will reach.

t(1) is a bare forward, not what plain `generate` pays per token at its fastest. `--plain` also times
plain greedy `generate` itself, per new token: on a DynamicCache (eager) and on a static cache, which
transformers' `generate` compiles on a GPU (CUDA graphs, `CompileConfig`'s "reduce-overhead"). The
fastest of those is the denominator a claim must use: `speedup_fastest(n) = τ(n) · g / (t(n) + d(n))`
with g the fastest plain per-token time. `--compiled-trees` times t(n) through a `torch.compile`d forward
(as `hf-bpd bench`'s `_compiled` methods run it) instead of the eager one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from statistics import median_high

import torch

from ..decode.binding import prepare
from ..decode.cost import measure_forward_cost, speedup_bound
from .bench.report import write_result_files

# Llama-shaped configurations (hidden, layers, attention heads, kv heads, MLP width, vocabulary)
SHAPES = {
    "tiny": (64, 2, 4, 2, 128, 512),  # CI on a CPU
    "135m": (576, 30, 9, 3, 1536, 49152),  # SmolLM2-135M
    "1b": (2048, 16, 32, 8, 8192, 128256),  # Llama-3.2-1B
    "7b": (4096, 32, 32, 32, 11008, 32000),  # Llama-2-7B
}
DEFAULT_TREE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


def random_llama(shape: str, device: str = "cpu", dtype: str = "float32"):
    """A Llama-shaped causal LM of `shape` (a `SHAPES` key) with random weights, initialised directly on
    `device` in `dtype` (no full-size copy on the host)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {sorted(SHAPES)}")
    hidden, layers, heads, kv_heads, mlp, vocab = SHAPES[shape]
    config = LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=mlp,
        vocab_size=vocab,
        max_position_embeddings=4096,
        tie_word_embeddings=shape in ("tiny", "135m", "1b"),
    )
    config._attn_implementation = "sdpa"
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))  # initialise in the target dtype, on the device itself
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def measure_draft_cost(model, tree_sizes, context: int = 256, repeats: int = 5) -> dict[int, float]:
    """Median seconds of one drafting step (heads, lookup chain, tree) growing a tree of n nodes, for
    shipped-style random heads on `model`."""
    from ..drafting.drafter import BlockDrafter
    from ..drafting.heads import BlockDraftHeads

    param = next(model.parameters())
    vocab = model.get_output_embeddings().weight.shape[0]
    draft_vocab = torch.arange(min(8192, vocab))
    heads = BlockDraftHeads.for_base_model(model, num_heads=5, token_input="previous", draft_vocab=draft_vocab)
    hidden = torch.randn(1, model.config.hidden_size, device=param.device, dtype=param.dtype)
    ids = torch.randint(0, vocab, (1, context), device=param.device)
    out = {}
    for n in tree_sizes:
        drafter = BlockDrafter(heads, top_k=10, max_tree_tokens=n, calibrate=True)
        prepare(drafter, model)
        times = []
        for _ in range(repeats + 1):  # the first run warms up
            _sync(param.device)
            t0 = time.perf_counter()
            drafter.draft(hidden, ids)
            _sync(param.device)
            times.append(time.perf_counter() - t0)
        out[n] = median_high(times[1:])
    return out


PLAIN_CACHES = ("dynamic", "static")


@torch.no_grad()
def measure_plain_generate(
    model, context: int = 256, new_tokens: int = 64, repeats: int = 3, errors: dict[str, str] | None = None
) -> dict[str, float]:
    """Median seconds per new token of plain greedy `generate` from a `context`-token prompt, per cache
    (`PLAIN_CACHES`): (time for 1 + new_tokens tokens - time for 1 token) / new_tokens, so the prefill is
    not counted. Both lengths run under the same `max_length` budget of the static cache, and one warm-up
    of each comes first (it compiles, where transformers compiles). A cache whose `generate` fails is left
    out, its error put in `errors`."""
    errors = {} if errors is None else errors
    param = next(model.parameters())
    vocab = model.get_output_embeddings().weight.shape[0]
    prompt = torch.randint(0, vocab, (1, context), generator=torch.Generator().manual_seed(0)).to(param.device)
    out = {}
    for cache in PLAIN_CACHES:

        def run(n: int, cache: str = cache) -> float:
            _sync(param.device)
            t0 = time.perf_counter()
            model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                do_sample=False,
                min_new_tokens=n,
                max_new_tokens=n,
                cache_implementation=cache,
                pad_token_id=0,
            )
            _sync(param.device)
            return time.perf_counter() - t0

        try:
            run(1), run(1 + new_tokens)  # warm-up (compiles a static cache's graphs on a GPU)
        except Exception as error:  # reported, and the cache left out of the fastest plain time
            errors[cache] = f"{type(error).__name__}: {error}"
            print(f"plain generate with a {cache} cache failed: {errors[cache]}", file=sys.stderr)
            continue
        per_token = [(run(1 + new_tokens) - run(1)) / new_tokens for _ in range(repeats)]
        out[cache] = median_high(per_token)
    return out


def read_replay_taus(path: str | Path) -> dict[int, float]:
    """τ per fixed tree size from a `hf-bpd replay --output` file (its limit table, else its drafters)."""
    report = json.loads(Path(path).read_text())
    if report.get("limits"):
        return {int(r["tree_tokens"]): float(r["tau"]) for r in report["limits"]}
    taus = {}
    for name, result in report.get("drafters", {}).items():
        size = next((int(part[1:]) for part in name.split() if part[:1] == "n" and part[1:].isdigit()), None)
        if size is not None:
            taus.setdefault(size, float(result["overall"]["tau"]))
    return taus


def projection(
    forward: dict[int, float], draft: dict[int, float], taus: dict[int, float], fastest_plain: float | None = None
) -> list[dict]:
    """Per tree size: t(n)/t(1), d(n)/t(1) and, where τ(n) is known, the projected speedup (module
    docstring) and the zero-overhead limit τ(n) t(1)/t(n); with `fastest_plain` (seconds per token of the
    fastest plain `generate`), also the projected speedup over it."""
    rows = []
    for n in sorted(forward):
        row = {"tree_tokens": n, "forward_s": forward[n], "draft_s": draft.get(n, 0.0)}
        row["forward_ratio"] = forward[n] / forward[1]
        row["draft_ratio"] = row["draft_s"] / forward[1]
        if n in taus:
            row["tau"] = taus[n]
            row["limit"] = speedup_bound(taus[n], forward[1], forward[n])
            row["speedup"] = speedup_bound(taus[n], forward[1], forward[n] + row["draft_s"])
            if fastest_plain is not None:
                row["speedup_fastest"] = speedup_bound(taus[n], fastest_plain, forward[n] + row["draft_s"])
        rows.append(row)
    return rows


def markdown(shape: str, rows: list[dict], plain: dict[str, float] | None = None) -> str:
    head = [f"**{shape}**", ""]
    if plain:
        cells = ", ".join(f"{cache} cache {1000 * s:.2f} ms" for cache, s in plain.items())
        head += [f"Plain greedy `generate` per new token: {cells}.", ""]
    fastest = plain and any("speedup_fastest" in r for r in rows)
    lines = [
        *head,
        "| n | t(n) ms | t(n)/t(1) | draft ms | τ(n) | limit τ·t(1)/t(n) | projected speedup |"
        + (" over fastest plain |" if fastest else ""),
        "| --- | --- | --- | --- | --- | --- | --- |" + (" --- |" if fastest else ""),
    ]
    for r in rows:
        tau = f"{r['tau']:.2f}" if "tau" in r else "–"
        limit = f"{r['limit']:.2f}x" if "limit" in r else "–"
        speed = f"{r['speedup']:.2f}x" if "speedup" in r else "–"
        lines.append(
            f"| {r['tree_tokens']} | {1000 * r['forward_s']:.1f} | {r['forward_ratio']:.2f} | "
            f"{1000 * r['draft_s']:.1f} | {tau} | {limit} | {speed} |"
            + (f" {r['speedup_fastest']:.2f}x |" if "speedup_fastest" in r else (" – |" if fastest else ""))
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-bpd cost-model", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["135m"], choices=sorted(SHAPES))
    parser.add_argument("--tree-sizes", type=int, nargs="+", default=list(DEFAULT_TREE_SIZES))
    parser.add_argument("--context", type=int, default=256, help="cached tokens before the tree")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on a CPU")
    parser.add_argument("--replay", default=None, help="a `hf-bpd replay --output` file giving τ per tree size")
    parser.add_argument("--output", default=None, help="JSON results; a .md table is written beside it")
    parser.add_argument(
        "--plain", action="store_true", help="also time plain greedy generate per token (dynamic and static cache)"
    )
    parser.add_argument("--compiled-trees", action="store_true", help="time t(n) through a torch.compile'd forward")
    args = parser.parse_args(argv)
    sizes = sorted(set(args.tree_sizes))
    if sizes[0] < 1:
        parser.error("--tree-sizes must be >= 1")
    if sizes[0] != 1:
        sizes = [1, *sizes]  # t(1) is the greedy baseline every ratio needs
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    taus = read_replay_taus(args.replay) if args.replay else {}

    from .bench import environment

    report = {"environment": environment(args.device, dtype), "args": vars(args), "shapes": {}}
    tables = []
    for shape in args.shapes:
        model = random_llama(shape, args.device, dtype)
        errors: dict[str, str] = {}
        plain = measure_plain_generate(model, args.context, repeats=args.repeats, errors=errors) if args.plain else {}
        if errors:
            report.setdefault("plain_generate_errors", {})[shape] = errors
        if args.compiled_trees:
            model.forward = torch.compile(model.forward, dynamic=True)  # as bench's `_compiled` methods
        curve = measure_forward_cost(model, sizes, context=args.context, repeats=args.repeats)
        forward = dict(zip(curve.sizes, curve.seconds))
        draft = measure_draft_cost(model, sizes, context=args.context, repeats=args.repeats)
        rows = projection(forward, draft, taus, min(plain.values()) if plain else None)
        report["shapes"][shape] = rows
        if plain:
            report.setdefault("plain_generate_s_per_token", {})[shape] = plain
        tables.append(markdown(shape, rows, plain))
        del model
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    text = "\n\n".join(tables)
    print(text)
    if args.output:
        write_result_files(args.output, report, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
