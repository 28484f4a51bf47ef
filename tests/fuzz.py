"""Differential fuzzer: hf_bpd.generate against plain `generate` on random models, prompts and options.

Each run draws, from its own seed: an architecture of the support matrix (`support_matrix.ROWS`), a dtype
(float32 or bfloat16), a prompt of 1-200 tokens, `max_new_tokens` 1-64, sometimes an eos token the model
is known to produce (so it falls inside accepted drafts), logits processors, top-k, a fixed or cost-sized
tree, heads with or without a draft vocabulary, a token input and a context-copy pointer, a context
rescorer, context lookup, and greedy or seeded sampling. Models are NOT sharpened: near-tied logits are
part of what is tested.

Every run ends in one of:
- `identical`: the same tokens as plain `generate` (greedy, or sampling with the same seed);
- `refused`: a ValueError raised before any forward, where the support matrix says the case is refused
  (a refusal anywhere else is a failure);
- `near_tie`: greedy outputs differ at a token where plain greedy's two best processed scores are within
  the rounding of the dtype (a tree forward and a one-token forward round differently). Sampled runs are
  float32 only and every divergence of theirs counts as a mismatch;
- `mismatch`: any other difference, or any other error. Each comes with its seed, a reproducer.

    python -m tests.fuzz --runs 5000 --output benchmarks/fuzz/fuzz_5000.json
    python -m tests.fuzz --seeds 1234            # rerun one case, printing it
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from support_matrix import ROWS, Row, build  # noqa: E402

import hf_bpd  # noqa: E402
from hf_bpd import BlockDrafter, BlockDraftHeads  # noqa: E402
from hf_bpd.decode.cost import ForwardCost  # noqa: E402
from hf_bpd.tools.forward_counter import ForwardCounter  # noqa: E402

# the gap between plain greedy's two best logits below which a tree forward may round the other way:
# a few units in the last place of the logits' magnitude in that dtype
TIE_RELATIVE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
TIE_ABSOLUTE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}
CPU_LIKE_COST = ForwardCost((1, 2, 4, 8, 16, 32), (0.047, 0.068, 0.071, 0.075, 0.088, 0.117))


@dataclass
class Case:
    seed: int
    row: str
    dtype: str
    prompt_len: int
    max_new_tokens: int
    eos: bool
    processors: dict
    do_sample: bool
    num_heads: int
    top_k: int
    tree: int | str
    draft_vocab: bool
    token_input: str
    copy_dim: int
    random_heads: bool
    context_rescorer: bool
    context_lookup: int


def draw_case(seed: int) -> Case:
    r = random.Random(seed)
    row = r.choice(ROWS)
    processors = {}
    if r.random() < 0.3:
        processors["repetition_penalty"] = r.choice([1.1, 1.5])
    if r.random() < 0.2:
        processors["no_repeat_ngram_size"] = r.choice([2, 3])
    if r.random() < 0.2:
        processors["min_new_tokens"] = r.randint(1, 10)
    if r.random() < 0.15:
        processors["suppress_tokens"] = r.sample(range(3, 97), 3)
    if r.random() < 0.15:
        processors["bad_words_ids"] = [[r.randrange(3, 97)], [r.randrange(3, 97), r.randrange(3, 97)]]
    do_sample = r.random() < 0.25
    if do_sample:
        processors["temperature"] = r.choice([0.7, 1.0, 1.3])
        if r.random() < 0.5:
            processors["top_k"] = r.choice([3, 10, 50])
        if r.random() < 0.5:
            processors["top_p"] = r.choice([0.8, 0.95])
    max_new_tokens = r.randint(1, 64)
    # stay inside the tiny models' 256 positions (GPT-2 and OPT have no positions past them)
    prompt_len = min(r.choice([r.randint(1, 8), r.randint(1, 60), r.randint(1, 200)]), 255 - max_new_tokens)
    return Case(
        seed=seed,
        row=row.name,
        # seeded sampling is compared token for token: only in float32, where a draw lands within rounding
        # of a boundary about never
        dtype="float32" if do_sample else r.choice(["float32", "float32", "bfloat16"]),
        prompt_len=prompt_len,
        max_new_tokens=max_new_tokens,
        eos=r.random() < 0.4,
        processors=processors,
        do_sample=do_sample,
        num_heads=r.randint(1, 5),
        top_k=r.choice([1, 2, 3, 5, 10]),
        tree=r.choice([1, 2, 4, 8, 16, 32, "auto"]),
        draft_vocab=r.random() < 0.3,
        token_input=r.choice(["", "next", "previous", "previous"]),
        copy_dim=r.choice([0, 0, 8]),
        random_heads=r.random() < 0.5,
        context_rescorer=r.random() < 0.2,
        context_lookup=r.choice([0, 10, 10]),
    )


_models: dict[tuple[str, str], torch.nn.Module] = {}


def model_for(row: Row, dtype: str):
    key = (row.name, dtype)
    if key not in _models:
        _models[key] = build(row).to(getattr(torch, dtype))
    return _models[key]


def make_drafter(model, case: Case) -> BlockDrafter:
    g = torch.Generator().manual_seed(case.seed)
    vocab = model.get_output_embeddings().weight.shape[0]
    draft_vocab = torch.randperm(vocab, generator=g)[: vocab // 2].sort().values if case.draft_vocab else None
    copy_dim = case.copy_dim if case.token_input == "previous" else 0  # the pointer reads the drafted token
    heads = BlockDraftHeads.for_base_model(
        model, num_heads=case.num_heads, draft_vocab=draft_vocab, token_input=case.token_input, copy_dim=copy_dim
    )
    if case.random_heads:
        with torch.no_grad():
            for p in heads.parameters():
                p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.2)
    rescorer = hf_bpd.NgramRescorer(context_weight=0.5, num_paths=2, beam=4) if case.context_rescorer else None
    top_k = min(case.top_k, heads.config.draft_vocab_size or vocab)
    tree = case.tree
    forward_cost = CPU_LIKE_COST if tree == "auto" else None  # auto without timing: a fixed CPU-like curve
    return BlockDrafter(
        heads,
        top_k=top_k,
        max_tree_tokens=32 if tree == "auto" else tree,
        forward_cost=forward_cost,
        rescorer=rescorer,
        context_lookup=case.context_lookup,
    )


def generate_kwargs(case: Case, eos: int | None) -> dict:
    kw = dict(max_new_tokens=case.max_new_tokens, do_sample=case.do_sample, pad_token_id=0, **case.processors)
    kw["eos_token_id"] = eos  # None: no eos at all, so lengths vary only by max_new_tokens
    return kw


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def near_tie(logits: torch.Tensor, dtype: torch.dtype) -> bool:
    top2 = logits.float().topk(2).values
    gap = float(top2[0] - top2[1])
    return gap <= TIE_ABSOLUTE[dtype] + TIE_RELATIVE[dtype] * float(top2[0].abs())


def run_case(case: Case) -> dict:
    row = next(r for r in ROWS if r.name == case.row)
    model = model_for(row, case.dtype)
    g = torch.Generator().manual_seed(case.seed)
    ids = torch.randint(3, 97, (1, case.prompt_len), generator=g)
    eos = None
    if case.eos and row.expected == "exact":  # a token plain decoding produces, so eos falls mid-draft
        probe = model.generate(ids, max_new_tokens=case.max_new_tokens, do_sample=False, eos_token_id=None)
        produced = probe[0, case.prompt_len + 1 :].tolist()
        eos = produced[len(produced) // 2] if produced else None
    kw = generate_kwargs(case, eos)
    drafter = make_drafter(model, case)
    from hf_bpd.decode.support import attention_windows

    # windows are served at every length (the windowed rows' windows of 16 are far shorter than most
    # cases), except one the masks cannot serve past (GPT-Neo's local layers: `cap`), served exactly while
    # prompt + new tokens fit it and refused otherwise; every other "refused" row always is
    cap = getattr(attention_windows(model), "cap", None)
    too_long = cap is not None and case.prompt_len + case.max_new_tokens > cap
    expect_refusal = too_long if cap is not None else row.expected == "refused"
    try:
        torch.manual_seed(case.seed)
        with ForwardCounter(model) as counter:
            out = model.generate(ids, custom_generate=hf_bpd.generate, assistant=drafter, **kw)
    except ValueError as err:
        if expect_refusal and counter.count == 0:
            return {"outcome": "refused"}
        return {"outcome": "mismatch", "error": f"ValueError after {counter.count} forwards: {err}"}
    except Exception:
        return {"outcome": "mismatch", "error": traceback.format_exc(limit=3)}
    if expect_refusal:
        return {"outcome": "mismatch", "error": "decoded a case the support matrix refuses"}
    torch.manual_seed(case.seed)
    ref = model.generate(ids, return_dict_in_generate=True, output_scores=True, **kw)
    a, b = out[0].tolist(), ref.sequences[0].tolist()
    if a == b:
        return {"outcome": "identical", "tau": drafter.stats.block_efficiency}
    i = first_difference(a, b)
    step = i - case.prompt_len
    # greedy picks the argmax of the processed scores: a tie there is what rounding can flip
    if not case.do_sample and 0 <= step < len(ref.scores) and near_tie(ref.scores[step][0], model.dtype):
        return {"outcome": "near_tie", "position": step}
    return {"outcome": "mismatch", "position": step, "ours": a[i : i + 5], "plain": b[i : i + 5]}


def fuzz(seeds, progress: bool = False) -> dict:
    results = []
    t0 = time.perf_counter()
    for n, seed in enumerate(seeds):
        case = draw_case(seed)
        result = run_case(case)
        results.append({"case": asdict(case), **result})
        if progress and (n + 1) % 100 == 0:
            counts = Counter(r["outcome"] for r in results)
            print(f"{n + 1} runs, {time.perf_counter() - t0:.0f} s: {dict(counts)}", flush=True)
    return summarize(results)


def summarize(results: list[dict]) -> dict:
    counts = Counter(r["outcome"] for r in results)
    by_dtype = {}
    for dtype in ("float32", "bfloat16"):
        runs = [r for r in results if r["case"]["dtype"] == dtype]
        decoded = [r for r in runs if r["outcome"] != "refused"]
        ties = sum(r["outcome"] == "near_tie" for r in runs)
        by_dtype[dtype] = {
            "runs": len(runs),
            "decoded": len(decoded),
            "near_ties": ties,
            "near_tie_rate": ties / len(decoded) if decoded else 0.0,
        }
    return {
        "runs": len(results),
        "outcomes": dict(counts),
        "by_dtype": by_dtype,
        "by_row": {
            name: dict(Counter(r["outcome"] for r in results if r["case"]["row"] == name))
            for name in sorted({r["case"]["row"] for r in results})
        },
        "mismatches": [r for r in results if r["outcome"] == "mismatch"],
        "near_ties": [
            {"seed": r["case"]["seed"], "row": r["case"]["row"], "dtype": r["case"]["dtype"]}
            for r in results
            if r["outcome"] == "near_tie"
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--start", type=int, default=0, help="first seed")
    parser.add_argument("--seeds", type=int, nargs="+", help="run exactly these seeds (reproducers)")
    parser.add_argument("--output", help="JSON summary")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    seeds = args.seeds or range(args.start, args.start + args.runs)
    if args.seeds:
        for seed in seeds:
            print(json.dumps({"case": asdict(draw_case(seed)), **run_case(draw_case(seed))}, default=str))
        return 0
    summary = fuzz(seeds, progress=True)
    summary["command"] = "python -m tests.fuzz " + " ".join(argv if argv is not None else sys.argv[1:])
    from hf_bpd.tools.bench import environment

    summary["environment"] = environment("cpu", "float32 and bfloat16")
    print(json.dumps({k: summary[k] for k in ("runs", "outcomes", "by_dtype")}, indent=1))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(summary, indent=1, default=str))
    return 1 if summary["outcomes"].get("mismatch") else 0


if __name__ == "__main__":
    sys.exit(main())
