"""`hf-bpd bench`: prompts (a Spec-Bench-format jsonl; by default the demo prompts bundled with the package),
several decoding methods in ONE process, interleaved per prompt so machine drift hits every method alike.

Per category and overall: tau (new tokens / base-model forwards; 1.00 for greedy), tokens/s, speedup over
the FASTEST plain `generate` of the run on the same prompts (plain greedy, or plain greedy on
`hf_bpd.fast_cpu`'s kernels, whichever was faster in that category, or overall), and whether every output
equals plain greedy's (the run exits 1 if one does not).
MT-bench rows: the second turn is asked after greedy's own first answer (the same input for every
method; a lossless method gives that answer too).
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import torch

from ...cpu import streamed_linear
from ...decode.cost import ForwardCost, measure_forward_cost
from ...drafting.drafter import BlockDrafter
from .data import DEFAULT_DATA, check_data_file, read_prompts, select_rows
from .journal import check_same_machine, load_journal, merge_journals, merged_environment, state_digest
from .methods import (
    COMPILE_SECONDS,
    GREEDY,
    STATIC,
    Method,
    assisted_method,
    bpd_method,
    captured_method,
    compiled_method,
    fast_cpu_method,
    greedy_bpd_method,
    greedy_method,
    learned,
    load_drafter,
    prompt_lookup_method,
    run_bench,
    static_cache_method,
    static_compiled_method,
)
from .report import drafted_step_share, environment, machine, round_speedups, summarize, write_report

# the methods `--methods` takes besides hf_bpd+RESCORER (`main` builds each on demand)
METHODS = (
    "greedy",
    "greedy_fast",
    "greedy_compiled",
    "prompt_lookup",
    "prompt_lookup_fast",
    "assisted",
    "hf_bpd",
    "hf_bpd_compiled",
    "greedy_static",
    "greedy_static_fast",
    "greedy_static_compiled",
    "hf_bpd_static",
    "hf_bpd_captured",
    "hf_bpd_typical",
    "hf_bpd_greedy",
    "hf_bpd_corpus",
)


def rescorer_specs(methods: list[str], model: str | None = None) -> dict:
    """The shipped specs of the rescorers the methods use for packaged `model` (the assisted method drafts
    with "neural")."""
    from ...io.packaged import packaged_rescorers

    specs = packaged_rescorers(model)
    names = [m.split("+", 1)[1] for m in methods if m.startswith("hf_bpd+")] + (["neural"] * ("assisted" in methods))
    return {n: specs.get(n) for n in names}


def cpu_kernel(device: str) -> str | None:
    """Which build of hf_bpd's CPU kernel a run on `device` times (None off the CPU): a journal keeps it."""
    return streamed_linear.version() if device == "cpu" else None


def _tree_size(value: str) -> int | str:
    return value if value == "auto" else int(value)


def share_forward_cost(curve: ForwardCost, drafters) -> None:
    """The run's forward-cost curve to each other drafter of the run with `auto` trees, so that one
    measurement serves them all. A drafter with an integer max_tree_tokens keeps its fixed trees: given a
    curve it would size each tree up to that bound and draft every step (`BlockDrafter`'s forward_cost),
    which is neither its setting nor how `generate` runs it."""
    for other in drafters:
        if other.max_tree_tokens == "auto":
            other.forward_cost = curve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-bpd bench", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "data",
        nargs="?",
        default=DEFAULT_DATA,
        help="prompts jsonl: Spec-Bench's format (question_id, category, turns) or one 'prompt' per row; default: "
        "the demo prompts bundled with the package. For Spec-Bench, pass its jsonl",
    )
    parser.add_argument("--model", default="packaged")
    parser.add_argument("--heads", default="packaged", help="heads folder, 'packaged', or 'untrained'")
    parser.add_argument("--num-heads", type=int, default=4, help="with --heads untrained")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument(
        "--max-tree-tokens", type=_tree_size, default=None, help="an integer, or 'auto' (sized by the forward cost)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--limit", type=int, default=None, help="rows in all")
    parser.add_argument("--per-category", type=int, default=None, help="rows per category")
    parser.add_argument("--spread", type=int, default=None, help="rows evenly spaced over the file")
    parser.add_argument("--categories", nargs="*", default=None)
    parser.add_argument(
        "--methods",
        nargs="+",
        default=["greedy", "greedy_fast", "prompt_lookup_fast", "hf_bpd"],
        help="greedy (always run: the reference), greedy_fast (plain generate on hf_bpd.fast_cpu's kernels, "
        "which hf_bpd's forwards use), greedy_compiled (plain generate with torch.compile and inductor freezing; "
        "speedups divide by the fastest plain method), greedy_static (plain generate on a static cache, which "
        "generate compiles with CUDA graphs on a GPU), greedy_static_fast (the same on fast_cpu's kernels), "
        "greedy_static_compiled (plain generate on a static cache compiled by transformers itself, CompileConfig, "
        "on any device), hf_bpd_static (hf_bpd on a static cache), hf_bpd_captured (greedy: hf_bpd's captured step "
        "on a static cache compiled by inductor, on the drafter's CPU kernels), prompt_lookup, "
        "prompt_lookup_fast, assisted (the shipped rescorer LM as a draft "
        "model), hf_bpd (heads alone), hf_bpd+NAME with NAME a shipped rescorer (hf_bpd.packaged_rescorers()), "
        "hf_bpd_typical (with --do-sample: Medusa's typical acceptance, lossy), hf_bpd_greedy (with --do-sample: "
        "the same drafter decoding greedily on the same turns, the greedy τ that sampling's τ is compared with), "
        "hf_bpd_corpus (the drafter with a retrieval corpus of the --corpus answers), hf_bpd@FOLDER (the drafter "
        "saved in FOLDER, with its drafter.json settings, which --top-k, --max-tree-tokens and --context-lookup "
        "override as they do --heads': two drafters compared in one run)",
    )
    parser.add_argument(
        "--corpus",
        nargs="+",
        default=None,
        help="distill output folders whose answers are hf_bpd_corpus's retrieval corpus (hf_bpd.CorpusIndex)",
    )
    parser.add_argument("--do-sample", action="store_true", help="sample (every method, the reference too)")
    parser.add_argument("--temperature", type=float, default=None, help="with --do-sample")
    parser.add_argument("--top-p", type=float, default=None, help="with --do-sample")
    parser.add_argument("--sample-top-k", type=int, default=None, help="with --do-sample: generate's top_k")
    parser.add_argument("--seed", type=int, default=0, help="with --do-sample: each turn's seed is derived from it")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--packed-linear",
        choices=["auto", "on", "off"],
        default="auto",
        help="hf_bpd's verification with oneDNN pre-packed linear weights (BlockDrafter's packed_linear)",
    )
    parser.add_argument(
        "--output",
        default=None,
        help="JSON results file; a .md table and a .journal.jsonl of every finished row are written beside it",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the --output run's journal (same settings): finished rows are kept, not rerun",
    )
    parser.add_argument(
        "--context-lookup", type=int, default=None, help="longest context-lookup chain (0: off; default: the drafter's)"
    )
    parser.add_argument("--overwrite", action="store_true", help="start over when --output's journal exists")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument(
        "--batch-size",
        type=int,
        nargs="+",
        default=[1],
        help="B > 1, or several sizes: first turns in left-padded batches of B, each decoded in one generate "
        "call, every size in this run (methods greedy and hf_bpd[+RESCORER]; no journal)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="with --batch-size: decode every batch this many times (each method's order turning each round)",
    )
    parser.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="JOURNAL",
        help="run nothing: summarize the finished rows of these journals (one run split with --categories over "
        "processes or machines) into --output",
    )
    args = parser.parse_args(argv)
    if args.merge:
        methods, records = merge_journals(args.merge)
        results = summarize(records, methods)
        info = {"merged": args.merge, "turns": len(records) // len(methods), **merged_environment(args.merge)}
        return write_report(results, info, args.output)

    if args.rounds < 1 or (args.rounds > 1 and args.batch_size == [1]):
        raise SystemExit(f"--rounds repeats the batches of --batch-size B > 1: it must be >= 1, got {args.rounds}")
    check_data_file(args.data)
    if ("hf_bpd_corpus" in args.methods) != bool(args.corpus):
        raise SystemExit("hf_bpd_corpus drafts from the answers of --corpus: give both, or neither")
    if min(args.batch_size) < 1:
        raise SystemExit(f"--batch-size must be >= 1, got {args.batch_size}")
    batched = args.batch_size != [1]
    if batched:
        unbatched = [m for m in args.methods if m.startswith(("prompt_lookup", "assisted"))]
        if unbatched or args.resume or args.do_sample:
            raise SystemExit(
                "--batch-size > 1 measures greedy hf_bpd methods against plain batched greedy (no --resume, no "
                f"--do-sample; transformers' prompt lookup and assisted generation take no batches): {unbatched}"
            )
    decoding = dict(GREEDY)
    if args.do_sample:
        options = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.sample_top_k}
        decoding = {"do_sample": True, **{k: v for k, v in options.items() if v is not None}}
    elif any(v is not None for v in (args.temperature, args.top_p, args.sample_top_k)):
        raise SystemExit("--temperature, --top-p and --sample-top-k shape sampling: add --do-sample")

    if args.resume and not args.output:
        raise SystemExit("--resume continues the journal of --output: give --output")
    journal = Path(args.output).with_suffix(".journal.jsonl") if args.output else None
    if args.resume:
        try:
            check_same_machine(journal, machine(args.device), cpu_kernel(args.device))
        except ValueError as e:
            raise SystemExit(str(e)) from None

    from ...io.models import load_model
    from ...io.packaged import resolve_packaged_name

    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    packaged = resolve_packaged_name(args.model)  # the packaged model whose heads and rescorers the run uses
    kwargs = {k: v for k, v in (("top_k", args.top_k), ("max_tree_tokens", args.max_tree_tokens)) if v is not None}

    def run_drafter(heads: str) -> BlockDrafter:
        drafter = load_drafter(heads, model, args.num_heads, packaged, **kwargs)
        drafter.packed_linear = {"auto": None, "on": True, "off": False}[args.packed_linear]
        if args.context_lookup is not None:
            drafter.context_lookup = args.context_lookup
        return drafter

    drafter = run_drafter(args.heads)
    others = {m: run_drafter(m.split("@", 1)[1]) for m in args.methods if m.startswith("hf_bpd@")}
    env = environment(args.device, args.dtype)  # before the run writes anything
    if journal is not None and journal.is_file() and not args.resume:
        if not args.overwrite:
            raise SystemExit(
                f"{journal} holds a run's finished rows: --resume to continue it, --overwrite to start over"
            )
        journal.unlink()
    header = {
        "data": args.data,
        "model": args.model,
        "heads": args.heads,
        "selection": [args.categories, args.per_category, args.limit, args.spread],
        "dtype": args.dtype,
        "device": args.device,
        "machine": env["device"],
        # the CPU kernel's source and build (a rebuilt kernel times differently): never one run across both
        "cpu_kernel": cpu_kernel(args.device),
        "drafter": {
            "num_heads": drafter.num_heads,
            "top_k": drafter.top_k,
            "max_tree_tokens": drafter.max_tree_tokens,
            "calibrate": drafter.calibration is not None,
            "packed_linear": args.packed_linear,
            "context_lookup": drafter.context_lookup,
            "heads_sha1": state_digest(drafter.heads.state_dict()),
        },
        **({"other_drafters": {m: state_digest(d.heads.state_dict()) for m, d in others.items()}} if others else {}),
        "rescorer_specs": rescorer_specs(args.methods, packaged),
        **({"corpus": args.corpus} if "hf_bpd_corpus" in args.methods else {}),
    }
    if args.do_sample:  # journals of greedy runs keep their header
        header["decoding"] = {**decoding, "seed": args.seed}
    if drafter.max_tree_tokens == "auto":  # one forward-cost curve for every hf_bpd method of the run
        old = load_journal(journal)[0] if args.resume else None
        if old and "forward_cost" in old:  # a resumed run keeps its curve
            drafter.forward_cost = ForwardCost(*map(tuple, old["forward_cost"]))
        else:
            drafter.forward_cost = measure_forward_cost(model, packed_linear=drafter.packed_linear)
        header["forward_cost"] = [list(drafter.forward_cost.sizes), list(drafter.forward_cost.seconds)]
        share_forward_cost(drafter.forward_cost, others.values())

    def with_rescorer(name: str) -> Method:
        from ...io.packaged import packaged_rescorer

        rescored = drafter.with_rescorer(packaged_rescorer(name, tokenizer, model=packaged))
        return bpd_method(model, rescored, f"hf_bpd+{name}", decoding)

    def assisted() -> Method:
        from ...io.packaged import packaged_rescorer

        small = packaged_rescorer("neural", tokenizer)
        small.bind(model)
        return assisted_method(model, small.lm, decoding=decoding)

    def typical() -> Method:
        if not args.do_sample:
            raise SystemExit("hf_bpd_typical is Medusa's (lossy) typical acceptance of sampled tokens: add --do-sample")
        # a drafter of its own (same heads and settings), so that its calibration is its own
        lossy = {**decoding, "lossy_typical_acceptance": True}
        return bpd_method(model, drafter.with_rescorer(drafter.rescorer), "hf_bpd_typical", lossy)

    def on_compiled_forward(drafter: BlockDrafter) -> BlockDrafter:
        """A copy of `drafter` (its own calibration) for the compiled forward: its linears are left to the
        compiled graph (`packed_linear` auto sees the compiled forward), and an "auto" curve is measured
        on that forward when it first runs there, not taken over from the packed one."""
        copy = drafter.with_rescorer(drafter.rescorer)
        copy.forward_cost = None
        return copy

    def captured() -> Method:
        from ...io.models import chat_inputs

        if args.do_sample:
            raise SystemExit("hf_bpd_captured is greedy (the captured step decodes greedily): drop --do-sample")
        first = [chat_inputs(tokenizer, [{"role": "user", "content": r["turns"][0]}]) for r in rows]
        lengths = [x["input_ids"].shape[1] for x in first]
        multi_turn = any(len(r["turns"]) > 1 for r in rows)
        return captured_method(model, drafter, tokenizer, args.max_new_tokens, lengths, multi_turn, decoding=decoding)

    def with_corpus() -> Method:
        from ...drafting.corpus import CorpusIndex
        from ...training.distill import load_distilled

        copy = drafter.with_rescorer(drafter.rescorer)  # its own calibration
        copy.corpus = CorpusIndex.from_answers(load_distilled(args.corpus)["response_ids"])
        return bpd_method(model, copy, "hf_bpd_corpus", decoding)

    def greedy_twin() -> Method:
        if not args.do_sample:
            raise SystemExit("hf_bpd_greedy is hf_bpd decoding greedily inside a sampled run: add --do-sample")
        return greedy_bpd_method(model, drafter)

    available = {
        "greedy": lambda: greedy_method(model, decoding),
        "greedy_fast": lambda: fast_cpu_method(greedy_method(model, decoding), model),
        "greedy_compiled": lambda: compiled_method(greedy_method(model, decoding), model, tokenizer),
        "prompt_lookup": lambda: prompt_lookup_method(model, decoding=decoding),
        "prompt_lookup_fast": lambda: fast_cpu_method(prompt_lookup_method(model, decoding=decoding), model),
        "assisted": assisted,
        "hf_bpd": lambda: bpd_method(model, drafter, decoding=decoding),
        "hf_bpd_compiled": lambda: compiled_method(
            bpd_method(model, on_compiled_forward(drafter), decoding=decoding), model, tokenizer
        ),
        # a static cache: plain generate's fastest decoding on a GPU, and hf_bpd on the same cache
        "greedy_static": lambda: static_cache_method(model, decoding),
        "greedy_static_fast": lambda: fast_cpu_method(static_cache_method(model, decoding), model),
        "greedy_static_compiled": lambda: static_compiled_method(model, tokenizer, decoding),
        "hf_bpd_static": lambda: bpd_method(
            model, drafter.with_rescorer(drafter.rescorer), "hf_bpd_static", {**decoding, **STATIC}
        ),
        "hf_bpd_captured": captured,
        "hf_bpd_typical": typical,
        "hf_bpd_greedy": greedy_twin,
        "hf_bpd_corpus": with_corpus,
    }
    assert set(available) == set(METHODS), sorted(set(available) ^ set(METHODS))
    rows = select_rows(read_prompts(args.data), args.categories, args.per_category, args.limit, args.spread)
    available |= {m: functools.partial(bpd_method, model, d, m, decoding) for m, d in others.items()}
    unknown = {m for m in args.methods if m not in available and not m.startswith("hf_bpd+")}
    if unknown:
        raise SystemExit(f"unknown methods {sorted(unknown)}; available: {sorted(available)} and hf_bpd+RESCORER")
    methods = [available["greedy"]()] + [
        available[m]() if m in available else with_rescorer(m.split("+", 1)[1]) for m in args.methods if m != "greedy"
    ]
    if batched:
        from .batch import run_batch_bench

        records = []
        for size in args.batch_size:
            records += run_batch_bench(
                model, tokenizer, rows, methods, args.max_new_tokens, size, len(records), args.rounds
            )
        info = {"environment": env, "args": vars(args), "rows": len(rows)}
        info["drafter"] = {"heads": args.heads, **header["drafter"]}
        info["forward_cost"] = header.get("forward_cost")
        info["row_tau"] = {r["category"]: [] for r in records}
        for r in records:
            info["row_tau"][r["category"]] += r.get("row_tau", [])
        info["round_speedups"] = round_speedups(records, [m.name for m in methods])
        info["drafted_step_share"] = drafted_step_share(records)
        return write_report(summarize(records, [m.name for m in methods]), info, args.output)
    seed = args.seed if args.do_sample else None
    results = run_bench(
        model, tokenizer, rows, methods, args.max_new_tokens, not args.no_progress, journal, header, seed
    )
    return write_report(
        results,
        {
            "environment": env,
            "args": vars(args),
            "drafter": {"heads": args.heads, **header["drafter"]},
            "rows": len(rows),
            "learned": learned(methods),  # rows of this process only (a resumed run relearns)
            "compile_seconds": COMPILE_SECONDS,
            "decoding": decoding,
        },
        args.output,
        sampled=args.do_sample,
    )


if __name__ == "__main__":
    raise SystemExit(main())
