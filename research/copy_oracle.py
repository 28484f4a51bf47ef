"""How often a model-free bigram lookup over the context names each head's target (the case for context copy).

    python -m research.copy_oracle --answers benchmarks/replay/spec_bench_dev_greedy128.jsonl

For every answer position p of every turn (greedy's cached answers, `hf-bpd replay --answers`) and every
head depth i = 1..h: the tree's root then is x[p-i], so the context is x[0..p-i]. Find the most recent
earlier j with (x[j-1], x[j]) = (x[p-2], x[p-1]) (falling back to x[j] = x[p-1] alone) and predict x[j+1].
Prints, per category, the share of positions where that prediction is the target ("hit") and where a
match was found at all ("found"). A head's top-1 accuracy is the number to compare "hit" with.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

from hf_bpd.io.jsonl import read_jsonl
from research import SPEC_BENCH_DEV


def bigram_lookup(seq: list[int], target: int, context_end: int) -> int | None:
    """The token after the most recent occurrence, in seq[0..context_end], of the bigram before `target`
    (or of its last token alone); None without a match."""
    a1, a2 = seq[target - 2], seq[target - 1]
    unigram = None
    for j in range(context_end - 1, 0, -1):
        if seq[j] == a2:
            if seq[j - 1] == a1:
                return seq[j + 1]
            if unigram is None:
                unigram = seq[j + 1]
    return unigram


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m research.copy_oracle", description=__doc__.split("\n\n")[0])
    parser.add_argument("data", nargs="?", default=SPEC_BENCH_DEV)
    parser.add_argument("--answers", required=True, help="greedy answers cache of `hf-bpd replay`")
    parser.add_argument("--heads", type=int, default=5)
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from hf_bpd.io.packaged import packaged_model_dir
    from hf_bpd.tools.replay import answered_turns, read_answers

    tokenizer = AutoTokenizer.from_pretrained(packaged_model_dir())
    _, answers = read_answers(args.answers)
    h = args.heads
    stats: dict[str, list[int]] = defaultdict(lambda: [0] * (1 + 2 * h))
    for row, prompt, answer in answered_turns(tokenizer, read_jsonl(args.data), answers):
        seq, start = prompt[0].tolist() + answer, prompt.shape[1]
        for cat in (row["category"], "all"):
            s = stats[cat]
            for p in range(start + 1, len(seq)):
                s[0] += 1
                for i in range(1, h + 1):
                    if p - i < start:  # the root must be an answer token
                        continue
                    guess = bigram_lookup(seq, p, p - i)
                    s[i] += guess == seq[p]
                    s[h + i] += guess is not None
    for cat, s in sorted(stats.items()):
        n = max(s[0], 1)
        hit = " ".join(f"{s[i] / n:.2f}" for i in range(1, h + 1))
        found = " ".join(f"{s[h + i] / n:.2f}" for i in range(1, h + 1))
        print(f"{cat:15s} positions {s[0]:6d}  hit {hit}  found {found}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
