"""What the shipped heads lose on their base model in another precision: τ of the SmolLM2 heads on the
packaged model (the Q4_1 GGUF, dequantised: what the heads were trained on) against the same model with
every weight matrix moved by seeded uniform noise of a fraction of a Q4_1 step per weight
(`research.quantise.perturb_weight_matrices`; at 1/2 step, as far as the un-quantised checkpoint can lie from
the dequantised one), same rows, same drafter settings.

τ comes from `hf-bpd replay` (`hf_bpd.tools.replay`: each model's own greedy answers, cached, replayed
with fresh drafters per model, so the acceptance calibration learns each model from the same start). The
perturbed model's losslessness is checked too: the shipped default drafter (`load_packaged_drafter()`,
binding checks the heads' LM-head fingerprint) decodes the first `--check-turns` turns on it with
`hf_bpd.generate`, `--check-max-new-tokens` tokens each (a greedy answer's first tokens are greedy's answer to
that length), compared token for token with its plain greedy answer.

    python -m research.perturbed_base_tau --per-category 2 --max-new-tokens 128 \
        --answers benchmarks/replay/spec_bench_dev_greedy128.jsonl \
        --perturbed-answers benchmarks/fingerprint/smollm2_half_q4_1_step_pc2_greedy128.jsonl \
        --output benchmarks/fingerprint/perturbed_base_tau_pc2.json
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

import hf_bpd
from hf_bpd.drafting.heads import lm_head_mismatch, matches_lm_head, sketch_correlation
from hf_bpd.io.jsonl import read_jsonl
from hf_bpd.io.packaged import load_packaged_drafter, packaged_heads_dir
from hf_bpd.tools.bench import check_data_file, environment, load_drafter, select_rows
from hf_bpd.tools.replay import answered_turns, answers_header, greedy_answers, replay
from research import SPEC_BENCH_DEV
from research.quantise import perturb_weight_matrices


def drafters_for(model, top_ks, sizes, lookups, label: str) -> dict:
    """Fresh shipped-heads drafters for `model`, one per setting, named `<label> k.. n.. lookup..`."""
    return {
        f"{label} k{k} n{n} lookup{lookup}": load_drafter(
            "packaged", model, top_k=k, max_tree_tokens=n, context_lookup=lookup
        )
        for k, n, lookup in itertools.product(top_ks, sizes, lookups)
    }


def repeated_ngram_share(answer: list[int], n: int = 4) -> tuple[int, int]:
    """(n-grams of `answer` seen earlier in it, n-grams in it): what context lookup can copy."""
    seen: set[tuple[int, ...]] = set()
    repeated = 0
    for i in range(len(answer) - n + 1):
        gram = tuple(answer[i : i + n])
        repeated += gram in seen
        seen.add(gram)
    return repeated, max(len(answer) - n + 1, 0)


def answer_statistics(answers: dict, reference: dict | None = None) -> dict:
    """Tokens and the share of repeated 4-grams over all `answers`; with `reference`, the mean number of
    leading tokens each answer shares with the reference's answer to the same turn."""
    counts = [repeated_ngram_share(a) for a in answers.values()]
    stats = {
        "tokens": sum(len(a) for a in answers.values()),
        "repeated_4gram_share": sum(r for r, _ in counts) / max(sum(n for _, n in counts), 1),
    }
    if reference is not None:
        shared = [
            next((i for i, (x, y) in enumerate(zip(a, reference[k])) if x != y), min(len(a), len(reference[k])))
            for k, a in answers.items()
        ]
        stats["mean_shared_prefix_with_packaged"] = sum(shared) / len(shared)
    return stats


def check_identical(model, tokenizer, rows, answers, turns: int, max_new_tokens: int) -> dict:
    """The shipped default drafter on the first `turns` turns, `max_new_tokens` each: outputs identical to
    `answers` (plain greedy, cut to that length) and its τ there."""
    drafter = load_packaged_drafter()
    identical = tokens = forwards = checked = 0
    for _, prompt, answer in itertools.islice(answered_turns(tokenizer, rows, answers), turns):
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            custom_generate=hf_bpd.generate,
            assistant=drafter,
        )
        identical += out[0, prompt.shape[1] :].tolist() == answer[:max_new_tokens]
        tokens += drafter.stats.new_tokens
        forwards += drafter.stats.forwards
        checked += 1
    return {
        "turns": checked,
        "identical_turns": identical,
        "tau": tokens / forwards,
        "max_new_tokens": max_new_tokens,
        "settings": "shipped default",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", nargs="?", default=SPEC_BENCH_DEV, help="Spec-Bench-format jsonl")
    parser.add_argument("--spread", type=int, default=None, help="rows evenly spaced over the file")
    parser.add_argument("--per-category", type=int, default=None, help="the first rows of each category")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--answers", required=True, help="the packaged model's greedy answers cache (jsonl)")
    parser.add_argument("--perturbed-answers", required=True, help="the perturbed model's greedy answers cache")
    parser.add_argument("--steps", type=float, default=0.5, help="noise amplitude in Q4_1 steps per weight")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--top-k", type=int, nargs="+", default=[10])
    parser.add_argument("--max-tree-tokens", type=int, nargs="+", default=[16], help="fixed tree sizes")
    parser.add_argument("--context-lookup", type=int, nargs="+", default=[0, 10], help="0: off")
    parser.add_argument("--check-turns", type=int, default=1000, help="turns decoded to check losslessness")
    parser.add_argument("--check-max-new-tokens", type=int, default=64, help="new tokens of each checked turn")
    parser.add_argument("--output", required=True)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    check_data_file(args.data)
    env = environment("cpu", "float32")
    model, tokenizer = hf_bpd.load_packaged_model()
    rows = select_rows(read_jsonl(args.data), None, args.per_category, None, args.spread)
    progress = not args.no_progress
    settings = (args.top_k, args.max_tree_tokens, args.context_lookup)

    header = answers_header(args.data, "packaged", args.max_new_tokens)
    answers = greedy_answers(model, tokenizer, rows, args.answers, header, progress)
    results = replay(model, tokenizer, rows, answers, drafters_for(model, *settings, "packaged"), progress)

    moved = perturb_weight_matrices(model, args.steps, args.seed)
    shipped = hf_bpd.BlockDraftHeads.saved_config(packaged_heads_dir())
    weight = model.get_output_embeddings().weight
    perturbation = {
        "noise": f"uniform, +-{args.steps} Q4_1 step per weight (blocks of 32), seed {args.seed}",
        "weight_matrices": moved,
        "sketch_correlation": sketch_correlation(weight, shipped.base_lm_head_sketch),
        "accepted": lm_head_mismatch(weight, shipped.base_lm_head_sketch, shipped.base_lm_head_fingerprint) is None,
        "accepted_by_row_sums": matches_lm_head(weight, shipped.base_lm_head_fingerprint),
    }
    print(json.dumps(perturbation))
    label = f"packaged + {args.steps} Q4_1-step noise (seed {args.seed})"
    perturbed_header = answers_header(args.data, label, args.max_new_tokens)
    perturbed = greedy_answers(model, tokenizer, rows, args.perturbed_answers, perturbed_header, progress)
    results.update(replay(model, tokenizer, rows, perturbed, drafters_for(model, *settings, "perturbed"), progress))
    same = sum(perturbed[key] == answers[key] for key in perturbed)
    turn_keys = [(row.get("question_id"), t) for row in rows for t in range(len(row["turns"]))]
    statistics = {
        "packaged": answer_statistics({k: answers[k] for k in turn_keys}),
        "perturbed": answer_statistics({k: perturbed[k] for k in turn_keys}, answers),
    }
    check = check_identical(model, tokenizer, rows, perturbed, args.check_turns, args.check_max_new_tokens)
    print(json.dumps(check))

    for name, r in results.items():
        print(f"{name}: τ {r['overall']['tau']:.3f}")
    report = {
        "environment": env,
        "args": vars(args),
        "rows": len(rows),
        "turns": sum(len(r["turns"]) for r in rows),
        "perturbation": {**perturbation, "answers_same_as_packaged": same},
        "identity_check": check,
        "answers": statistics,
        "drafters": results,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
