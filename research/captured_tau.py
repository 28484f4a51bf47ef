"""τ of the captured step's FIXED tree (`hf_bpd/decode/captured.py`: `Topology.best_first` over the heads' top-k
with the rank prior, no context lookup) on the real SmolLM2-135M-Instruct, float32, measured on a CPU: τ is
a count (new tokens per verification forward), not a time, so it does not depend on the machine's speed or
load. The shipped drafter at `max_tree_tokens` 8, 16 and 32, `captured_step=True` (on a CPU the same step,
run eagerly), on the first N rows of tests/data/spec_bench_sample.jsonl (dev rows spread over the
categories), first turns, 128 new tokens; each answer checked against plain static-cache greedy `generate`.

    python -m research.captured_tau --rows 10 --output benchmarks/gpu/captured_tau_smollm2_cpu.json

`--trees eager` adds the shipped eager drafter replayed on the same turns (`hf-bpd replay`'s turn replay), the
τ the captured step's trees are compared with.

`--replay`: the same fixed tree REPLAYED on SmolLM2's stored greedy answers
(benchmarks/replay/spec_bench_dev_greedy128.jsonl, 128 new tokens, first turns of the same rows): one
forward of prompt + answer gives the hidden state at every position; from each step's root (the last
accepted token) the step's own `draft_tokens` builds the bucket's tree from the hidden state that predicted
the root, and the deepest node whose path is the answer's next tokens is accepted, plus the bonus token, as
the step's greedy accept does (exact where the teacher-forced argmax is the decoded one: float32, no ties).
Minutes instead of the decode's hour on a loaded 2-core machine.

    python -m research.captured_tau --replay --rows 10 --output benchmarks/gpu/captured_tau_smollm2_cpu.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import hf_bpd
from hf_bpd.io.models import chat_inputs

SAMPLE = Path(__file__).resolve().parents[1] / "tests" / "data" / "spec_bench_sample.jsonl"


REPLAY = Path(__file__).resolve().parents[1] / "benchmarks" / "replay" / "spec_bench_dev_greedy128.jsonl"


@torch.no_grad()
def replay_steps(
    model, heads, bucket, prompt_ids: torch.Tensor, answer: list[int], state, calibration, learning: bool
) -> tuple[int, int]:
    """(new tokens, steps) of the captured step's tree (fixed, or grown each step) over one stored greedy
    answer. `learning`: the step's calibration learns from each walk (`observe_walk`), from `calibration`'s
    sums, which it updates after the answer (a drafter serving the rows one call after another)."""
    from hf_bpd.decode.captured import fixed_tree, grown_tree, observe_walk

    ids = torch.cat([prompt_ids.view(-1), torch.tensor(answer, dtype=torch.long)])
    hidden = model(ids[None], output_hidden_states=True, return_dict=True).hidden_states[-1][0].to(heads.dtype)
    p = prompt_ids.numel()
    # the sequence buffer holds the whole answer: the lookup reads only the first root + 1 tokens
    state.load(ids, hidden[p - 1], 10**9, calibration if learning else None)
    done, steps = 1, 0  # prefill emits the first answer token (the first root)
    while done < len(answer):
        root = p + done - 1  # index in ids of the root; hidden[root - 1] predicted it
        state.root.copy_(ids[root].view(1))
        state.hidden.copy_(hidden[root - 1][None])
        if bucket.grown:
            tree = grown_tree(heads, bucket, state, torch.tensor(root))
        else:
            tree = fixed_tree(heads, bucket, state)
        tokens, parents, depths = tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()
        drafted = tree.drafted.tolist()
        ok = [True] * len(tokens)
        deepest = 0
        for i in range(1, len(tokens)):
            pos = root + depths[i]
            ok[i] = drafted[i] and ok[parents[i]] and pos < ids.numel() and tokens[i] == int(ids[pos])
            if ok[i] and depths[i] > depths[deepest]:
                deepest = i
        count = min(depths[deepest] + 1, len(answer) - done)
        done, steps = done + count, steps + 1
        if learning:
            observe_walk(state, tree, tree.ancestors[deepest], tree.drafted & (bucket.slots != 0))
    if learning:
        state.save(calibration)
    return len(answer), steps  # as `stats.block_efficiency` counts: the prefill's token too


def eager_replay(model, drafter, rows, prompts, answers, n: int) -> dict:
    """τ of the shipped drafter's eager step (host-grown tree, lookup merged by `merge_lookup`, calibration
    learning as it decodes) over the same first turns and stored answers, one drafter for every row."""
    from hf_bpd.tools.replay import replay_turn

    tokens = steps = 0
    per_row = []
    for r in rows:
        result = replay_turn(model, drafter, prompts[r["question_id"]], answers[r["question_id"]])
        tokens, steps = tokens + result.tokens, steps + result.forwards
        per_row.append(round(result.tau, 3))
    return tau_row("eager", n, tokens, steps, per_row, drafter)


def tau_row(tree: str, n: int, tokens: int, steps: int, per_row: list[float], drafter) -> dict:
    """One tree's result: its τ over every row, and each row's."""
    return {
        "tree": tree,
        "tree_tokens": n,
        "tau": tokens / steps,
        "new_tokens": tokens,
        "steps": steps,
        "tau_per_row": per_row,
        "top_k": drafter.top_k,
        "heads": drafter.heads.num_heads,
    }


@torch.no_grad()
def replay(args) -> dict:
    from hf_bpd.decode.captured import CapturedState, Topology, TreeBucket

    model, tokenizer = hf_bpd.load_packaged_model("float32")
    rows = [json.loads(line) for line in SAMPLE.read_text().splitlines()][: args.rows]
    answers = {}
    for line in REPLAY.read_text().splitlines()[1:]:
        r = json.loads(line)
        if r["turn"] == 0:
            answers[r["question_id"]] = r["answer_ids"]
    result = {
        "model": "SmolLM2-135M-Instruct",
        "dtype": "float32",
        "rows": [r["dev_row"] for r in rows],
        "max_new_tokens": 128,
        "method": "replay of stored greedy answers",
        "answers": str(REPLAY.name),
        "sizes": {},
    }
    prompts = {
        r["question_id"]: chat_inputs(tokenizer, [{"role": "user", "content": r["turns"][0]}])["input_ids"]
        for r in rows
    }
    for tree in args.trees:
        for n in args.sizes:
            drafter = hf_bpd.load_packaged_drafter(max_tree_tokens=n)
            if tree == "eager":  # the shipped eager drafter itself, replayed (`hf-bpd replay`'s own turn replay)
                result["sizes"][f"eager{n}"] = eager_replay(model, drafter, rows, prompts, answers, n)
                print(json.dumps({k: v for k, v in result["sizes"][f"eager{n}"].items() if k != "tau_per_row"}))
                continue
            heads = drafter.heads.bind(model)
            kind, cpu = heads.config.token_input, torch.device("cpu")
            if tree == "fixed":
                topology = Topology.best_first(n, heads.num_heads, drafter.top_k)
                bucket = TreeBucket(topology, kind, cpu, capacity=4096)
            else:
                topology, lookup = None, drafter.context_lookup if tree in ("lookup", "learned") else 0
                bucket = TreeBucket(
                    None, kind, cpu, 4096, size=n, max_depth=heads.num_heads, top_k=drafter.top_k, lookup=lookup
                )
            depth = max(bucket.max_depth, heads.num_heads)
            state = CapturedState.empty(heads.config.hidden_size, depth, 4096, "cpu", heads.dtype)
            tokens = steps = 0
            per_row = []
            for r in rows:
                prompt, answer = prompts[r["question_id"]], answers[r["question_id"]]
                new, k = replay_steps(
                    model, heads, bucket, prompt, answer, state, drafter.calibration, learning=tree == "learned"
                )
                tokens, steps = tokens + new, steps + k
                per_row.append(round(new / max(k, 1), 3))
            row = tau_row(tree, n, tokens, steps, per_row, drafter)
            if topology is not None:
                row["topology_paths"] = [list(q) for q in topology.paths()[1:]]
            result["sizes"][str(n) if tree == "fixed" else f"{tree}{n}"] = row
            print(json.dumps({k: v for k, v in row.items() if k not in ("topology_paths", "tau_per_row")}), flush=True)
    return result


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=10)
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--output", default=None)
    parser.add_argument("--replay", action="store_true")
    parser.add_argument(
        "--trees",
        nargs="+",
        choices=["fixed", "grown", "lookup", "learned", "eager"],
        default=["fixed", "grown", "lookup", "learned"],
        help="with --replay; learned: lookup, with the calibration learning on the device from every walk; eager: "
        "the shipped eager drafter on the same turns (what the captured step is compared with)",
    )
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.replay:
        t0 = time.time()
        result = replay(args)
        result.update(seconds=round(time.time() - t0, 1), torch=torch.__version__, machine="CPU, 2 threads, shared")
        if args.output:
            Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
        return
    model, tokenizer = hf_bpd.load_packaged_model("float32")
    rows = [json.loads(line) for line in SAMPLE.read_text().splitlines()][: args.rows]
    inputs = [chat_inputs(tokenizer, [{"role": "user", "content": r["turns"][0]}]) for r in rows]
    common = dict(cache_implementation="static", do_sample=False, max_new_tokens=args.max_new_tokens)
    t0 = time.time()
    plain = [model.generate(**x, **common) for x in inputs]
    result = {
        "model": "SmolLM2-135M-Instruct",
        "dtype": "float32",
        "rows": [r["dev_row"] for r in rows],
        "max_new_tokens": args.max_new_tokens,
        "sizes": {},
    }
    for n in args.sizes:
        drafter = hf_bpd.load_packaged_drafter(max_tree_tokens=n)
        tokens = steps = same = 0
        per_row = []
        for x, ref in zip(inputs, plain):
            out = model.generate(**x, **common, custom_generate=hf_bpd.generate, assistant=drafter, captured_step=True)
            s = drafter.stats
            tokens, steps = tokens + s.new_tokens, steps + s.steps
            same += int(out.tolist() == ref.tolist())
            per_row.append(round(s.new_tokens / max(s.steps, 1), 3))
        row = {
            "tree_tokens": n,
            "tau": tokens / steps,
            "new_tokens": tokens,
            "steps": steps,
            "identical": same,
            "of": len(inputs),
            "tau_per_row": per_row,
            "top_k": drafter.top_k,
            "heads": drafter.heads.num_heads,
        }
        result["sizes"][str(n)] = row
        print(json.dumps(row), flush=True)
    result.update(seconds=round(time.time() - t0, 1), torch=torch.__version__, machine="CPU, 2 threads, shared")
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
