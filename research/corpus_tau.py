"""Issue #59: τ of the shipped drafter with and without retrieval drafts from the model's own answers
(`hf_bpd/drafting/corpus.py`), replayed on Spec-Bench's stored greedy answers as `hf-bpd replay` does, at
fixed tree sizes, in one run. The corpus is the answers of the given distilled folders (none of them are
Spec-Bench's).

    python -m research.corpus_tau --corpus training/data/distilled/distill2 training/data/distilled/distill_instr \\
        training/data/distilled/distill_self --spread 40 --output benchmarks/replay/corpus_spread40.json
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch

from hf_bpd.drafting.corpus import CorpusIndex
from hf_bpd.tools.bench import environment, load_drafter, read_prompts, select_rows
from hf_bpd.tools.bench.report import write_result_files
from hf_bpd.tools.replay import answers_header, greedy_answers, markdown_table, replay
from hf_bpd.training.distill import load_distilled

ANSWERS = "benchmarks/replay/spec_bench_dev_greedy128.jsonl"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="../shared/data/spec_bench_dev.jsonl")
    parser.add_argument("--model", default="packaged", help="a packaged model: its shipped drafter drafts")
    parser.add_argument("--answers", default=ANSWERS, help="greedy answers cache of that model (hf-bpd replay's)")
    parser.add_argument("--corpus", nargs="+", required=True, help="distilled folders whose answers are the corpus")
    parser.add_argument("--max-answers", type=int, default=None, help="the corpus' first N answers (shard order)")
    parser.add_argument(
        "--fractions", type=float, nargs="+", default=[1.0], help="random parts of the corpus (seed 0), one index each"
    )
    parser.add_argument("--max-ngram", type=int, nargs="+", default=[6], help="longest corpus matches (one index each)")
    parser.add_argument("--corpus-nodes", type=int, nargs="+", default=[10], help="corpus nodes merged per step")
    parser.add_argument("--max-tree-tokens", type=int, nargs="+", default=[4, 8, 16, 64])
    parser.add_argument("--context-lookup", type=int, nargs="+", default=[10])
    parser.add_argument("--spread", type=int, default=None)
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)

    from hf_bpd.io.models import load_model
    from hf_bpd.io.packaged import resolve_packaged_name

    t0 = time.perf_counter()
    corpus = load_distilled(args.corpus)["response_ids"][: args.max_answers]
    order = torch.randperm(len(corpus), generator=torch.Generator().manual_seed(0)).tolist()
    indexes = {}
    for fraction, n in itertools.product(args.fractions, args.max_ngram):
        part = corpus if fraction >= 1 else [corpus[i] for i in sorted(order[: round(fraction * len(corpus))])]
        name = f"corpus{n}" + ("" if fraction >= 1 else f" {fraction:g}")
        indexes[name] = CorpusIndex.from_answers(part, max_ngram=n)
    built = (time.perf_counter() - t0) / len(indexes)
    model, tokenizer = load_model(args.model, dtype="float32", device="cpu")
    packaged = resolve_packaged_name(args.model)
    rows = select_rows(read_prompts(args.data), None, None, None, args.spread)
    env = environment("cpu", "float32")
    answers = greedy_answers(model, tokenizer, rows, args.answers, answers_header(args.data, args.model, 128), False)
    drafters = {}
    for lookup in args.context_lookup:
        for size in args.max_tree_tokens:
            name = f"n{size} lookup{lookup}"
            settings = dict(packaged_model=packaged, top_k=10, max_tree_tokens=size, context_lookup=lookup)
            drafters[name] = load_drafter("packaged", model, **settings)
            for (corpus_name, index), nodes in itertools.product(indexes.items(), args.corpus_nodes):
                drafter = load_drafter("packaged", model, **settings)
                drafter.corpus, drafter.corpus_nodes = index, nodes
                drafters[f"{name} {corpus_name}x{nodes}"] = drafter
    results = replay(model, tokenizer, rows, answers, drafters, progress=True)
    table = markdown_table(results)
    print(table)
    report = {
        "environment": env,
        "args": vars(args),
        "rows": len(rows),
        "corpus_answers": len(corpus),
        "corpus_tokens": {name: len(index) for name, index in indexes.items()},
        "index_seconds": built,
        "drafters": results,
    }
    write_result_files(args.output, report, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
