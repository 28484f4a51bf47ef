"""How much of greedy's text a draft vocabulary can draft, and how much of the rest the context holds.

A drafter with a draft vocabulary (the shipped heads' and the EAGLE layers': 8,192 of SmolLM2's 49,152 tokens)
can never propose a token outside it, except by copying the context (the context lookup, or an EAGLE layer's
`context_vocab`). Over every turn of the Spec-Bench dev rows' cached greedy answers, per category: the share of
answer tokens inside the draft vocabulary, the share of the others that the context already held (the prompt,
with its chat template, or the answer before them), and how many distinct tokens outside the vocabulary a
turn's context holds (what `context_vocab` adds to the layer's softmax).

    python -m research.draft_vocab_coverage --output benchmarks/eagle/draft_vocab_coverage_dev.json
    python -m research.draft_vocab_coverage --model gemma-3-270m --heads hf_bpd/assets/gemma3_270m/heads \
        --answers benchmarks/replay/gemma3_270m_dev_greedy128.jsonl
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from hf_bpd.drafting.files import drafting_module
from hf_bpd.io.models import load_model
from hf_bpd.tools.bench import environment, read_prompts, select_rows
from hf_bpd.tools.replay import answered_turns, read_answers
from research import SPEC_BENCH_DEV


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=SPEC_BENCH_DEV)
    parser.add_argument("--answers", default="benchmarks/replay/spec_bench_dev_greedy128.jsonl")
    parser.add_argument("--model", default="packaged", help="the packaged model the answers are greedy's of")
    parser.add_argument("--heads", default="hf_bpd/assets/smollm2/heads", help="heads or layer folder")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)

    env = environment("cpu", "float32")
    module = drafting_module(args.heads)
    if not module.config.draft_vocab_size:
        raise SystemExit(f"{args.heads} drafts the whole vocabulary: every token is inside it")
    inside = set(module.draft_vocab.tolist())
    _, tokenizer = load_model(args.model)
    rows = select_rows(read_prompts(args.data), None, None, None, None)
    _, answers = read_answers(args.answers)
    counts = defaultdict(lambda: {"tokens": 0, "outside": 0, "outside_in_context": 0, "turns": 0, "context_extra": 0})
    for row, prompt, answer in answered_turns(tokenizer, rows, answers):
        context = set(prompt[0].tolist())
        turn = {"tokens": len(answer), "outside": 0, "outside_in_context": 0, "turns": 1}
        for token in answer:
            if token not in inside:
                turn["outside"] += 1
                turn["outside_in_context"] += token in context
            context.add(token)
        turn["context_extra"] = len(context - inside)
        for key in (row["category"], "overall"):
            for name, value in turn.items():
                counts[key][name] += value
    report = {}
    for key, c in counts.items():
        report[key] = {
            "tokens": c["tokens"],
            "inside_share": 1 - c["outside"] / c["tokens"],
            "outside_in_context_share": c["outside_in_context"] / max(c["outside"], 1),
            "context_tokens_outside_per_turn": c["context_extra"] / c["turns"],
        }
    for key, r in sorted(report.items(), key=lambda kv: (kv[0] == "overall", kv[0])):  # the table: results.py
        print(f"{key}: {r['inside_share']:.3f} inside, {r['outside_in_context_share']:.3f} of the rest in context")
    if args.output:
        Path(args.output).write_text(
            json.dumps({"environment": env, "args": vars(args), "categories": report}, indent=1) + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
