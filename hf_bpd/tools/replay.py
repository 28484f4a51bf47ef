"""`hf-bpd replay`: τ of draft heads on Spec-Bench-format prompts without running a tree forward.

Lossless decoding emits greedy's answer whatever was drafted, so each step's outcome follows from that
answer alone: at a step that starts with t answer tokens emitted, the tree's root is answer[t-1] and the
base model accepts the longest tree path spelling answer[t], answer[t+1], ... plus one token of its own.
The hidden state the heads read at that step is the base model's at position prompt + t - 2 (the one that
chose the root), which one teacher-forced forward over prompt + answer gives for every t at once.

So a replay runs the base model once per turn, plus the drafter's own work (heads, tree growth, the
acceptance calibration fed as decoding feeds it) per step, instead of one tree forward per step: all of
Spec-Bench dev in minutes on a CPU, for any number of drafter settings in one pass over the answers.

Greedy answers are generated once per data file and `max_new_tokens` (plain `generate`, batch 1, as the
bench's reference) into a resumable jsonl cache (`--answers`). What replay cannot show: speed (no tree is
verified) and losslessness (assumed; `hf-bpd bench` checks it). Its τ equals the decoding loop's up to
float noise in the heads' input (teacher-forced vs tree-attention hidden states); docs/history.md compares
the two on the same rows.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..decode.binding import prepare
from ..decode.cost import ForwardCost, measure_forward_cost, speedup_bound
from ..drafting.drafter import BlockDrafter
from ..drafting.layer_features import decoding_features
from ..io.models import chat_inputs
from .bench import DEFAULT_DATA, check_data_file, environment, load_drafter, read_prompts, select_rows
from .bench.report import write_result_files


@dataclass
class ReplayResult:
    """One turn replayed: `tokens` emitted (the answer's length) in `forwards` base-model forwards
    (prefill + one per step, as `DecodingStats` counts them)."""

    tokens: int
    forwards: int
    accepted_lengths: list[int] = field(default_factory=list)
    tree_sizes: list[int] = field(default_factory=list)

    @property
    def tau(self) -> float:
        return self.tokens / self.forwards


def accept_along(tree, answer: list[int], start: int) -> tuple[list[int], bool]:
    """The tree nodes greedy decoding accepts at a step that starts with `start` answer tokens emitted
    (root first), and whether the answer ends inside them (then the last node's children were never
    compared, as `accept.accept_tree` stops on the stopping criteria)."""
    nodes = [0]
    while True:
        k = start + len(nodes) - 1  # the answer token the base model chooses at nodes[-1]
        if k + 1 >= len(answer):
            return nodes, True
        child = tree.child(nodes[-1], answer[k])
        if child is None:
            return nodes, False
        nodes.append(child)


def answer_hidden_states(model, prompt_ids: torch.Tensor, answer: list[int], heads=None) -> torch.Tensor:
    """Last hidden states `[prompt + answer, hidden]` of one teacher-forced forward; for `heads` reading
    feature layers, their fused state of those layers instead (as decoding gives them: `layer_features.py`)."""
    ids = torch.cat([prompt_ids, prompt_ids.new_tensor([answer])], dim=-1)
    with torch.no_grad(), decoding_features(model, heads):
        out = model(input_ids=ids, output_hidden_states=True, return_dict=True)
    return out.hidden_states[-1][0]


def _reads_feature_layers(drafter: BlockDrafter) -> bool:
    return bool(getattr(getattr(drafter.heads, "config", None), "feature_layers", None))


def replay_turn(
    model, drafter: BlockDrafter, prompt_ids: torch.Tensor, answer: list[int], hidden: torch.Tensor | None = None
) -> ReplayResult:
    """Replay lossless decoding of greedy's `answer` to `prompt_ids [1, P]` with `drafter` (batch 1).
    `hidden`: `answer_hidden_states`, when several drafters replay the same turn."""
    if not answer:
        raise ValueError("an empty answer: greedy generated no token")
    step_cost = prepare(drafter, model).step_cost
    if hidden is None:
        hidden = answer_hidden_states(model, prompt_ids, answer, drafter.heads)
    p = prompt_ids.shape[1]
    context = getattr(model.config, "max_position_embeddings", None)
    result = ReplayResult(tokens=len(answer), forwards=1)
    t = 1  # the prefill emitted answer[0]
    if drafter.reads_context:  # position i's feature and the token after it, as `row.decode` hands them over
        drafter.start_context(hidden[:p], prompt_ids[0, 1:].tolist() + answer[:1])
    while t < len(answer):
        sequence = torch.cat([prompt_ids, prompt_ids.new_tensor([answer[:t]])], dim=-1)
        max_depth = None if context is None else max(context - (p + t - 1) - 1, 0)  # as `row.decode`
        tree = drafter.draft(hidden[p + t - 2][None], sequence, max_depth, step_cost=step_cost)[0]
        nodes, finished = accept_along(tree, answer, t)
        drafter.observe([nodes], [finished])
        if drafter.reads_context and t + len(nodes) < len(answer):
            drafter.extend_context(hidden[p + t - 1 : p + t - 1 + len(nodes)], answer[t : t + len(nodes)])
        t += len(nodes)
        result.forwards += 1
        result.accepted_lengths.append(len(nodes))
        result.tree_sizes.append(len(tree))
    return result


def answers_header(data: str, model_name: str, max_new_tokens: int) -> dict:
    import transformers

    return {
        "data": data,
        "model": model_name,
        "max_new_tokens": max_new_tokens,
        "transformers": transformers.__version__,
    }


def read_answers(path: str | Path) -> tuple[dict | None, dict[tuple, list[int]]]:
    """An answers cache's header and its answers, {(question_id, turn): answer ids}."""
    lines = Path(path).read_text().splitlines()
    header = json.loads(lines[0]).get("header") if lines else None
    answers = {}
    for line in lines[1:]:
        try:
            r = json.loads(line)
        except json.JSONDecodeError:  # the last line of a run killed mid-write
            continue
        answers[(r["question_id"], r["turn"])] = r["answer_ids"]
    return header, answers


def answered_turns(tokenizer, rows: list[dict], answers: dict[tuple, list[int]], device="cpu"):
    """Every turn of `rows` as (row, prompt ids [1, P], greedy's answer): the chat template over the turns so
    far, MT-bench second turns following greedy's first answer as the bench runs them."""
    for row in rows:
        messages: list[dict] = []
        for t, turn in enumerate(row["turns"]):
            messages.append({"role": "user", "content": turn})
            prompt = chat_inputs(tokenizer, messages, device)["input_ids"]
            answer = answers[(row.get("question_id"), t)]
            yield row, prompt, answer
            messages.append({"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)})


def greedy_answers(
    model, tokenizer, rows: list[dict], path: str | Path, header: dict, progress: bool = True
) -> dict[tuple, list[int]]:
    """{(question_id, turn): greedy answer ids} for every turn of `rows`, generated into the jsonl cache
    `path` where missing (batch 1, as `hf-bpd bench`'s reference; MT-bench second turns follow greedy's
    first answer). A cache written with another header is refused."""
    from tqdm import tqdm

    path = Path(path)
    cached: dict[tuple, list[int]] = {}
    if path.is_file():
        old, cached = read_answers(path)
        if old != header:
            raise ValueError(f"{path} holds answers for other settings ({old} vs {header}): use another --answers")
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"header": header}) + "\n")
    device = next(model.parameters()).device
    todo = [r for r in rows if any((r.get("question_id"), t) not in cached for t in range(len(r["turns"])))]
    with open(path, "a") as f:
        for row in tqdm(todo, disable=not progress, desc="greedy answers"):
            messages: list[dict] = []
            for t, turn in enumerate(row["turns"]):
                messages.append({"role": "user", "content": turn})
                inputs = chat_inputs(tokenizer, messages, device)
                key = (row.get("question_id"), t)
                if key not in cached:
                    out = model.generate(**inputs, do_sample=False, max_new_tokens=header["max_new_tokens"])
                    cached[key] = out[0, inputs["input_ids"].shape[1] :].tolist()
                    record = {"question_id": key[0], "turn": t, "answer_ids": cached[key]}
                    f.write(json.dumps(record) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
                text = tokenizer.decode(cached[key], skip_special_tokens=True)
                messages.append({"role": "assistant", "content": text})
    return cached


def replay(
    model,
    tokenizer,
    rows: list[dict],
    answers: dict[tuple, list[int]],
    drafters: dict[str, BlockDrafter],
    progress: bool = True,
) -> dict[str, dict]:
    """Replay every turn of `rows` with each drafter (in row order, so calibration learns as in a bench
    run). Returns {name: {"overall": {tau, tokens, forwards}, "categories": {...}}}."""
    from tqdm import tqdm

    totals = {name: defaultdict(lambda: [0, 0]) for name in drafters}
    device = next(model.parameters()).device
    turns = sum(len(r["turns"]) for r in rows)
    for row, prompt, answer in tqdm(
        answered_turns(tokenizer, rows, answers, device), total=turns, disable=not progress, desc="replay"
    ):
        hidden = None  # the final hidden states, shared by the drafters whose heads read them alone
        for name, drafter in drafters.items():
            if _reads_feature_layers(drafter):  # its own fusion of its own layers
                result = replay_turn(model, drafter, prompt, answer, None)
            else:
                hidden = answer_hidden_states(model, prompt, answer) if hidden is None else hidden
                result = replay_turn(model, drafter, prompt, answer, hidden)
            for key in ("overall", row["category"]):
                totals[name][key][0] += result.tokens
                totals[name][key][1] += result.forwards

    def summary(tokens: int, forwards: int) -> dict:
        return {"tau": tokens / forwards, "tokens": tokens, "forwards": forwards}

    return {
        name: {
            "overall": summary(*t["overall"]),
            "categories": {c: summary(*v) for c, v in sorted(t.items()) if c != "overall"},
        }
        for name, t in totals.items()
    }


def markdown_table(results: dict) -> str:
    """τ per category (rows) and drafter setting (columns)."""
    names = list(results)
    cats = list(next(iter(results.values()))["categories"])
    lines = ["| category | " + " | ".join(f"{n} τ" for n in names) + " |", "|" + " --- |" * (1 + len(names))]
    for cat in [*cats, "overall"]:
        scope = [results[n]["overall"] if cat == "overall" else results[n]["categories"][cat] for n in names]
        cells = [f"{s['tau']:.2f}" for s in scope]
        lines.append(f"| {'**overall**' if cat == 'overall' else cat} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def limit_table(results: dict, drafters: dict[str, BlockDrafter], curve: ForwardCost) -> list[dict]:
    """Per fixed-size drafter: tau(n), the forward cost t(n)/t(1) and the speedup a drafter with zero
    overhead would reach, tau(n) t(1)/t(n) (the bound its tree size allows on this device)."""
    rows = []
    for name, drafter in drafters.items():
        n = drafter.max_tree_tokens
        tau = results[name]["overall"]["tau"]
        limit = speedup_bound(tau, curve(1), curve(n))
        rows.append({"drafter": name, "tree_tokens": n, "tau": tau, "cost_ratio": curve(n) / curve(1), "limit": limit})
    return rows


def limit_markdown(limits: list[dict]) -> str:
    lines = ["| drafter | tree tokens | τ | t(n)/t(1) | limit τ·t(1)/t(n) |", "| --- | --- | --- | --- | --- |"]
    for r in limits:
        lines.append(
            f"| {r['drafter']} | {r['tree_tokens']} | {r['tau']:.2f} | {r['cost_ratio']:.2f} | {r['limit']:.2f}x |"
        )
    return "\n".join(lines)


def first_turns(rows: list[dict], max_turns: int | None) -> list[dict]:
    """`rows` with only their first `max_turns` turns (None: all; the rows themselves are left as they are)."""
    if max_turns is None:
        return rows
    return [{**row, "turns": row["turns"][:max_turns]} for row in rows]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-bpd replay", description=__doc__.split("\n\n")[0])
    parser.add_argument("data", nargs="?", default=DEFAULT_DATA, help="prompts jsonl (default: bundled demo prompts)")
    parser.add_argument("--model", default="packaged")
    parser.add_argument("--heads", nargs="+", default=["packaged"], help="heads folders, or 'packaged'")
    parser.add_argument("--top-k", type=int, nargs="+", default=[10])
    parser.add_argument("--max-tree-tokens", type=int, nargs="+", default=[64], help="fixed tree sizes")
    parser.add_argument(
        "--context-lookup", type=int, nargs="+", default=[10], help="longest context-lookup chains (0: off)"
    )
    parser.add_argument(
        "--lookup-nodes",
        type=int,
        nargs="+",
        default=[0],
        help="context lookup as a tree of what followed every occurrence, up to this many nodes (0: one chain)",
    )
    parser.add_argument(
        "--lookup-after-drafts",
        type=int,
        nargs="+",
        default=[0],
        help="most probable drafted nodes below which the context is looked up with their path appended (0: off)",
    )
    parser.add_argument(
        "--context-vocab",
        type=int,
        nargs="+",
        choices=[0, 1],
        default=None,
        help="1: also draft the context's tokens outside the draft vocabulary (EAGLE layers, and 'previous' heads "
        "tied to the LM head without a context copy; default: the folder's drafter.json)",
    )
    parser.add_argument(
        "--rescorers",
        nargs="+",
        default=["none"],
        help="shipped rescorers of the model (`hf_bpd.packaged_rescorers`) to draft with; 'none': heads alone",
    )
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--answers", required=True, help="greedy answers cache (jsonl; generated where missing)")
    parser.add_argument("--limit", type=int, default=None, help="rows in all")
    parser.add_argument("--per-category", type=int, default=None, help="rows per category")
    parser.add_argument("--spread", type=int, default=None, help="rows evenly spaced over the file")
    parser.add_argument("--categories", nargs="*", default=None)
    parser.add_argument(
        "--max-turns", type=int, default=None, help="replay only each row's first N turns (default: every turn)"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--output", default=None, help="JSON results; a .md table is written beside it")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument(
        "--limit-table",
        action="store_true",
        help="also time forwards of each tree size in this run and print the zero-overhead limit tau(n) t(1)/t(n)",
    )
    args = parser.parse_args(argv)
    check_data_file(args.data)
    if args.max_turns is not None and args.max_turns < 1:
        raise SystemExit(f"--max-turns must be at least 1, got {args.max_turns}")
    if min(args.lookup_nodes) < 0 or min(args.lookup_after_drafts) < 0:
        raise SystemExit("--lookup-nodes and --lookup-after-drafts must be at least 0")

    from ..io.models import load_model
    from ..io.packaged import check_shipped_rescorers, packaged_heads_dir, packaged_rescorer, resolve_packaged_name

    packaged = resolve_packaged_name(args.model)
    if args.context_vocab is not None and 1 in args.context_vocab:  # before the model loads
        from ..drafting.context_vocab import context_vocab_refusal
        from ..drafting.saved import DraftingModuleConfig

        for heads in args.heads:
            folder = packaged_heads_dir(packaged) if heads == "packaged" else heads
            why = context_vocab_refusal(DraftingModuleConfig.get_config_dict(str(folder))[0])
            if why:
                raise SystemExit(f"--context-vocab 1: {heads}: {why}")
    try:  # before the model loads
        check_shipped_rescorers([name for name in args.rescorers if name != "none"], packaged)
    except ValueError as err:
        raise SystemExit(str(err)) from None
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    rows = select_rows(read_prompts(args.data), args.categories, args.per_category, args.limit, args.spread)
    rows = first_turns(rows, args.max_turns)
    env = environment(args.device, args.dtype)  # before the run writes anything (the answers cache too)
    header = answers_header(args.data, args.model, args.max_new_tokens)
    answers = greedy_answers(model, tokenizer, rows, args.answers, header, not args.no_progress)
    drafters = {}
    for heads in args.heads:
        for k in args.top_k:
            for size in args.max_tree_tokens:
                vocabs = args.context_vocab or [None]
                settings = itertools.product(
                    args.context_lookup, args.lookup_nodes, args.lookup_after_drafts, vocabs, args.rescorers
                )
                for lookup, nodes, after, vocab, rescorer in settings:
                    name = f"k{k} n{size}" + (f" lookup{lookup}" if len(args.context_lookup) > 1 else "")
                    name += f" tree{nodes}" if len(args.lookup_nodes) > 1 else ""
                    name += f" after{after}" if len(args.lookup_after_drafts) > 1 else ""
                    name += f" vocab{vocab}" if len(vocabs) > 1 else ""
                    vocab_setting = {} if vocab is None else {"context_vocab": bool(vocab)}
                    name = f"{Path(heads).name} {name}" if len(args.heads) > 1 else name
                    name += f" +{rescorer}" if len(args.rescorers) > 1 else ""
                    drafter = load_drafter(
                        heads,
                        model,
                        packaged_model=packaged,
                        top_k=k,
                        max_tree_tokens=size,
                        context_lookup=lookup,
                        context_lookup_nodes=nodes or None,
                        lookup_after_drafts=after,
                        **vocab_setting,
                    )
                    if rescorer != "none":
                        drafter = drafter.with_rescorer(packaged_rescorer(rescorer, tokenizer, model=packaged))
                    drafters[name] = drafter
    results = replay(model, tokenizer, rows, answers, drafters, not args.no_progress)
    table = markdown_table(results)
    limits = None
    if args.limit_table:
        curve = measure_forward_cost(model, sorted({1, *args.max_tree_tokens}))  # packed as decoding runs
        limits = limit_table(results, drafters, curve)
        table += "\n\n" + limit_markdown(limits)
    print(table)
    if args.output:
        report = {"environment": env, "args": vars(args), "rows": len(rows)}
        if limits is not None:
            report["limits"] = limits
        write_result_files(args.output, {**report, "drafters": results}, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
