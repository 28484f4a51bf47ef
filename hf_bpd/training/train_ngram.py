"""`hf-bpd train-ngram`: a modified Kneser-Ney n-gram LM over the base model's token ids, for `NgramRescorer`.

Each token id is a word; each distilled sample (prompt ids, then the model's own response ids) is a
sentence. Counting, discounting and entropy pruning are kaldingram's (pure Python, no `lmplz` needed);
this script adds what KenLM needs to be usable for rescoring and what makes the file checkable:

  <unk>       kaldingram writes none, and KenLM then scores every unseen id log10 P = -100, which wipes
              out any lattice path through a token the corpus lacks. <unk> gets the probability of the
              rarest seen unigram: unseen ids are improbable, not impossible.
  ngram.json  vocabulary size, tokenizer fingerprint, order, pruning, data: `NgramLM` refuses a file made
              for another vocabulary or tokenizer.

Output folder: ngram.arpa.gz (KenLM reads gzip ARPA), ngram.json.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import io
import json
import math
import random
import time
from pathlib import Path


def corpus_lines(data, include_prompts: bool = True) -> list[str]:
    """One line of space-separated token ids per distilled sample."""
    lines = []
    for row in data:
        ids = (list(row["prompt_ids"]) if include_prompts else []) + list(row["response_ids"])
        if ids:
            lines.append(" ".join(map(str, ids)))
    return lines


def add_unk(arpa_text: str) -> str:
    """Insert an <unk> unigram (probability of the rarest unigram, no back-off) into ARPA text."""
    lines = arpa_text.split("\n")
    if any(line.split("\t")[1:2] == ["<unk>"] for line in lines):
        return arpa_text
    start = lines.index("\\1-grams:") + 1
    end = start
    lowest = 0.0
    while end < len(lines) and lines[end].strip():
        logp = float(lines[end].split("\t")[0])
        if logp > -99:  # <s> is written with -99
            lowest = min(lowest, logp)
        end += 1
    lines.insert(end, f"{lowest:.7f}\t<unk>\t0")
    for i, line in enumerate(lines):
        if line.startswith("ngram 1="):
            lines[i] = f"ngram 1={int(line.split('=')[1]) + 1}"
            break
    return "\n".join(lines)


def train_arpa(lines: list[str], order: int, prune_threshold: float = 0.0, min_counts: list[int] | None = None) -> str:
    """Kneser-Ney ARPA text (with <unk>) from corpus lines; entropy-pruned when prune_threshold > 0."""
    from kaldingram.prune import ArpaParser, prune
    from kaldingram.train import NgramCounts

    if not 1 <= order <= 5:
        raise ValueError(f"order must be in 1..5, got {order}")
    counts = NgramCounts(order)
    with contextlib.redirect_stderr(io.StringIO()):  # kaldingram's per-order progress bars
        for line in lines:
            counts.add_raw_counts_from_line(line)
        if min_counts and any(min_counts):
            counts.apply_count_cutoffs((list(min_counts) + [0] * order)[:order])
        counts.cal_discounting_constants()
        counts.cal_f()
        counts.cal_bow()
        buf = io.StringIO()
        counts.print_as_arpa(fout=buf)
    text = buf.getvalue()
    if prune_threshold > 0:
        parser = ArpaParser()
        lm = parser.load(io.StringIO(text))[0]
        prune(lm, prune_threshold, 2)
        out = io.StringIO()
        parser.dump(lm, out)
        text = out.getvalue()
    return add_unk(text)


def train_ngram(
    data,
    output: str | Path,
    order: int = 4,
    prune_threshold: float = 0.0,
    include_prompts: bool = True,
    heldout_fraction: float = 0.05,
    seed: int = 0,
    vocab_size: int | None = None,
    tokenizer=None,
    min_counts: list[int] | None = None,
) -> dict:
    """Train, write `output/ngram.arpa.gz` + `ngram.json`, and report held-out perplexity per token."""
    from hf_bpd.drafting.rescoring.ngram import NGRAM_METADATA, NgramLM
    from hf_bpd.drafting.vocab import tokenizer_fingerprint

    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    lines = corpus_lines(data, include_prompts)
    order_idx = list(range(len(lines)))
    random.Random(seed).shuffle(order_idx)
    n_held = int(len(lines) * heldout_fraction)
    held = [lines[i] for i in order_idx[:n_held]]
    train = [lines[i] for i in order_idx[n_held:]]
    t0 = time.time()
    text = train_arpa(train, order, prune_threshold, min_counts)
    arpa = output / "ngram.arpa.gz"
    tmp = arpa.with_suffix(".tmp")
    with gzip.open(tmp, "wt", encoding="utf-8") as f:
        f.write(text)
    tmp.replace(arpa)
    counts = {
        int(line.split()[1].split("=")[0]): int(line.split("=")[1])
        for line in text[: text.index("\\1-grams:")].splitlines()
        if line.startswith("ngram ")
    }
    meta = {
        "format": "hf_bpd-ngram-v1",
        "order": order,
        "vocab_size": vocab_size,
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer) if tokenizer is not None else None,
        "prune_threshold": prune_threshold,
        "min_counts": min_counts,
        "include_prompts": include_prompts,
        "train_samples": len(train),
        "train_tokens": sum(line.count(" ") + 1 for line in train),
        "ngram_counts": counts,
        "train_seconds": round(time.time() - t0, 1),
        "file_bytes": arpa.stat().st_size,
    }
    (output / NGRAM_METADATA).write_text(json.dumps(meta, indent=2))
    if held:
        lm = NgramLM(arpa, vocab_size=vocab_size)
        total, n = 0.0, 0
        for line in held:
            ids = [int(w) for w in line.split()]
            total += lm.sequence_logprob(ids)
            n += len(ids)
        meta["heldout_tokens"] = n
        meta["heldout_perplexity"] = round(math.exp(-total / n), 2)
        (output / NGRAM_METADATA).write_text(json.dumps(meta, indent=2))
    return meta


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", required=True, help="output folder of `hf-bpd distill` (or its dataset/)")
    parser.add_argument("--output", required=True, help="folder for ngram.arpa.gz and ngram.json")
    parser.add_argument("--order", type=int, default=4, choices=[2, 3, 4, 5])
    parser.add_argument("--prune", type=float, default=0.0, help="entropy-pruning threshold (0: none)")
    parser.add_argument("--min-counts", type=int, nargs="*", default=None, help="count cutoffs per order")
    parser.add_argument("--responses-only", action="store_true", help="leave the prompts out of the corpus")
    parser.add_argument("--model", default="packaged", help="base model (for vocabulary size and tokenizer)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-bpd train-ngram", description=__doc__.split("\n")[0])
    add_args(parser)
    args = parser.parse_args(argv)
    from hf_bpd.drafting.vocab import model_vocab_size
    from hf_bpd.io.models import load_model
    from hf_bpd.training.distill import load_distilled

    model, tokenizer = load_model(args.model)
    meta = train_ngram(
        load_distilled(args.data),
        args.output,
        order=args.order,
        prune_threshold=args.prune,
        include_prompts=not args.responses_only,
        vocab_size=model_vocab_size(model),
        tokenizer=tokenizer,
        min_counts=args.min_counts,
    )
    print(json.dumps(meta, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
