"""`hf-bpd analyze`: the paper's analyses of draft heads on a real model, with plots.

For each Spec-Bench row, the base model's greedy answer is computed once; one teacher-forced forward
then gives the last hidden state at every answer position t, hence every step's lattice as decoding would
see it after accepting the answer up to t. From those lattices:

1. Repetition: % of neighbouring draft tokens that are identical, and the mean longest run, in the
   heads' top-1 draft (vanilla) and in the rescorer's best draft (rescored), per category.
2. Head confidence: each head's entropy distribution; h_max = the last head up to which mean entropy
   rises monotonically, against tau per category, with the correlation.
3. Oracle headroom: tau of an oracle that accepts the longest prefix of the true continuation found in
   the top-k lattice, for k = 1..16 (k = 1: the heads' top-1 draft).
4. Wins / ties / losses of the rescored vs the vanilla top-1 draft (accepted length against the true
   continuation), and the share of wins where the rescorer removed a repeat the vanilla draft had.

tau here is simulated exactly as decoding proceeds with one draft per step (accept the matching prefix
plus the base model's own token), so it needs no timing and is the same on every machine.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path

import torch

from ..drafting.lattice import Lattice
from ..drafting.layer_features import decoding_features

MAX_K = 16


def simulated_tau(accept: list[int]) -> float:
    """tau of decoding that, at answer position t, accepts accept[t] drafted tokens plus one."""
    t, steps, n = 0, 0, len(accept)
    while t < n:
        t += accept[t] + 1
        steps += 1
    return n / (steps + 1)  # + 1: the prefill forward, as in DecodingStats


def prefix_match(draft, truth) -> int:
    n = 0
    for a, b in zip(draft, truth):
        if a != b:
            break
        n += 1
    return n


def repeats(draft) -> tuple[int, int, int]:
    """(identical neighbour pairs, pairs, longest run of one token)."""
    same = sum(1 for a, b in zip(draft, draft[1:]) if a == b)
    run = best = 1
    for a, b in zip(draft, draft[1:]):
        run = run + 1 if a == b else 1
        best = max(best, run)
    return same, max(len(draft) - 1, 0), best


def entropy(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), -1)
    return -(logp.exp() * logp).sum(-1)


def h_max(mean_entropy: list[float]) -> int:
    """The last head (1-based) up to which mean entropy rises monotonically."""
    h = 1
    while h < len(mean_entropy) and mean_entropy[h] > mean_entropy[h - 1]:
        h += 1
    return h


def pearson(x: list[float], y: list[float]) -> float:
    n = len(x)
    if n < 3:
        return math.nan
    mx, my = sum(x) / n, sum(y) / n
    sx = math.sqrt(sum((a - mx) ** 2 for a in x))
    sy = math.sqrt(sum((b - my) ** 2 for b in y))
    return sum((a - mx) * (b - my) for a, b in zip(x, y)) / (sx * sy) if sx and sy else math.nan


@torch.no_grad()
def analyze_row(model, drafter, rescorer, prompt_ids: list[int], answer: list[int]) -> dict:
    """Per-position statistics of one answer."""
    heads = drafter.heads
    ids = torch.tensor([prompt_ids + answer])
    with decoding_features(model, heads):  # heads reading feature layers: their fused state, as decoding has it
        hidden = model(ids, output_hidden_states=True).hidden_states[-1][0]
    p = len(prompt_ids)
    # position t of the answer is drafted from the hidden state of the token before it
    states = hidden[p - 1 : p - 1 + len(answer)]
    # answer[t] is token t+1 of position t; heads that read tokens get the true ones (teacher forcing)
    h = heads.num_heads
    continuation = torch.tensor([(answer[t : t + h] + [-1] * h)[:h] for t in range(len(answer))])
    logits = heads(states.to(heads.dtype), heads.teacher_forced_tokens(continuation))  # [T, h, S]
    token_ids = heads.draft_vocab if heads.config.draft_vocab_size else None
    lattice = Lattice.from_logits(logits, min(MAX_K, logits.shape[-1]), token_ids)
    out = defaultdict(list)
    out["entropy"] = entropy(logits).tolist()  # [T][h]
    if rescorer is not None and hasattr(rescorer, "reset"):
        rescorer.reset()
    for t in range(len(answer)):
        truth = answer[t + 1 : t + 1 + h]  # answer[t] is the base model's own token at step t
        if len(truth) < h:
            break
        tokens_t, logprobs_t = lattice.tokens[t : t + 1], lattice.logprobs[t : t + 1]  # [1, h, K]
        for k in range(1, MAX_K + 1):
            top_k = Lattice(tokens_t[:, :, :k], logprobs_t[:, :, :k])
            out[f"oracle_k{k}"].append(int(top_k.oracle_length(torch.tensor([truth]))[0]))
        vanilla = tokens_t[0, :, 0].tolist()
        out["vanilla"].append(prefix_match(vanilla, truth))
        vanilla_repeats = repeats(vanilla)
        out["vanilla_repeats"].append(vanilla_repeats)
        if rescorer is not None:
            row = Lattice(tokens_t[:, :, : drafter.top_k], logprobs_t[:, :, : drafter.top_k])
            context = torch.tensor([prompt_ids + answer[: t + 1]])
            rescored = list(rescorer(row, context)[0][0].tokens)
            rescored_repeats = repeats(rescored)
            out["rescored"].append(prefix_match(rescored, truth))
            out["rescored_repeats"].append(rescored_repeats)
            out["repair"].append(vanilla_repeats[0] > 0 and rescored_repeats[0] == 0)
    return dict(out)


def summarise(per_category: dict[str, list[dict]], num_heads: int) -> dict:
    report = {}
    for cat, rows in sorted(per_category.items()):
        r: dict = {}
        r["tau_vanilla"] = sum(simulated_tau(row["vanilla"]) for row in rows) / len(rows)
        ent = [e for row in rows for e in row["entropy"]]
        r["mean_entropy"] = [sum(e[i] for e in ent) / len(ent) for i in range(num_heads)]
        r["entropy_samples"] = [[e[i] for e in ent] for i in range(num_heads)]
        r["h_max"] = h_max(r["mean_entropy"])
        r["oracle_tau"] = {
            k: sum(simulated_tau(row[f"oracle_k{k}"]) for row in rows) / len(rows) for k in range(1, MAX_K + 1)
        }
        for kind in ("vanilla", "rescored"):
            reps = [x for row in rows for x in row.get(f"{kind}_repeats", [])]
            if reps:
                r[f"repeat_pct_{kind}"] = 100 * sum(s for s, _, _ in reps) / max(sum(n for _, n, _ in reps), 1)
                r[f"max_run_{kind}"] = sum(b for _, _, b in reps) / len(reps)
        if rows and "rescored" in rows[0]:
            r["tau_rescored"] = sum(simulated_tau(row["rescored"]) for row in rows) / len(rows)
            pairs = [(v, s, rep) for row in rows for v, s, rep in zip(row["vanilla"], row["rescored"], row["repair"])]
            wins = [p for p in pairs if p[1] > p[0]]
            r["wins"], r["ties"] = len(wins), sum(1 for v, s, _ in pairs if s == v)
            r["losses"] = len(pairs) - r["wins"] - r["ties"]
            r["wins_with_repeat_repaired_pct"] = 100 * sum(1 for p in wins if p[2]) / len(wins) if wins else 0.0
        report[cat] = r
    cats = list(report)
    report_all = {
        "h_max_tau_correlation": pearson([report[c]["h_max"] for c in cats], [report[c]["tau_vanilla"] for c in cats])
    }
    return {"categories": report, **report_all}


def plot(summary: dict, out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats = list(summary["categories"])
    data = summary["categories"]
    files = []

    if "repeat_pct_rescored" in data[cats[0]]:
        fig, ax = plt.subplots(figsize=(9, 4))
        x = range(len(cats))
        ax.bar([i - 0.2 for i in x], [data[c]["repeat_pct_vanilla"] for c in cats], 0.4, label="vanilla (heads' top-1)")
        ax.bar([i + 0.2 for i in x], [data[c]["repeat_pct_rescored"] for c in cats], 0.4, label="rescored")
        ax.set_xticks(list(x), cats, rotation=45, ha="right")
        ax.set_ylabel("% identical neighbouring draft tokens")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / "repetition.png", dpi=110)
        files.append("repetition.png")

        fig, ax = plt.subplots(figsize=(9, 4))
        w = [data[c]["wins"] for c in cats]
        t = [data[c]["ties"] for c in cats]
        lo = [data[c]["losses"] for c in cats]
        ax.bar(cats, w, label="wins")
        ax.bar(cats, t, bottom=w, label="ties")
        ax.bar(cats, lo, bottom=[a + b for a, b in zip(w, t)], label="losses")
        ax.set_ylabel("draft steps (rescored vs vanilla)")
        ax.tick_params(axis="x", rotation=45)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / "wins_ties_losses.png", dpi=110)
        files.append("wins_ties_losses.png")

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for c in cats:
        axes[0].plot(range(1, len(data[c]["mean_entropy"]) + 1), data[c]["mean_entropy"], marker="o", label=c)
    axes[0].set_xticks(range(1, len(data[cats[0]]["mean_entropy"]) + 1))
    axes[0].set_xlabel("head")
    axes[0].set_ylabel("mean entropy (nats)")
    axes[0].legend(fontsize=7)
    axes[1].scatter([data[c]["h_max"] for c in cats], [data[c]["tau_vanilla"] for c in cats])
    for c in cats:
        axes[1].annotate(c, (data[c]["h_max"], data[c]["tau_vanilla"]), fontsize=7)
    axes[1].set_xlabel("h_max")
    axes[1].set_ylabel("tau (top-1 draft)")
    axes[1].set_title(f"corr = {summary['h_max_tau_correlation']:.2f}")
    fig.tight_layout()
    fig.savefig(out_dir / "entropy_hmax.png", dpi=110)
    files.append("entropy_hmax.png")

    fig, ax = plt.subplots(1, 1, figsize=(11, 4))
    heads = len(data[cats[0]]["entropy_samples"])
    samples = [[e for c in cats for e in data[c]["entropy_samples"][i]] for i in range(heads)]
    ax.violinplot(samples, showmedians=True)
    ax.set_xlabel("head")
    ax.set_ylabel("entropy (nats), all categories")
    fig.tight_layout()
    fig.savefig(out_dir / "entropy_distribution.png", dpi=110)
    files.append("entropy_distribution.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    for c in cats:
        ks = sorted(data[c]["oracle_tau"], key=int)
        ax.plot([int(k) for k in ks], [data[c]["oracle_tau"][k] for k in ks], label=c)
    ax.set_xlabel("k (lattice width)")
    ax.set_ylabel("oracle tau")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "oracle_tau_vs_k.png", dpi=110)
    files.append("oracle_tau_vs_k.png")
    plt.close("all")
    return files


def markdown(summary: dict, files: list[str]) -> str:
    data = summary["categories"]
    cats = list(data)
    rescored = "tau_rescored" in data[cats[0]]
    lines = [
        "| category | τ top-1 | "
        + (
            "τ rescored | repeat % vanilla → rescored | max run | W/T/L | wins w/ repeat repaired | "
            if rescored
            else ""
        )
        + "h_max | mean entropy per head | oracle τ k=1/4/8/16 |"
    ]
    lines.append("|" + " --- |" * (lines[0].count("|") - 1))
    for c in cats:
        r = data[c]
        cells = [c, f"{r['tau_vanilla']:.2f}"]
        if rescored:
            cells += [
                f"{r['tau_rescored']:.2f}",
                f"{r['repeat_pct_vanilla']:.1f} → {r['repeat_pct_rescored']:.1f}",
                f"{r['max_run_vanilla']:.2f} → {r['max_run_rescored']:.2f}",
                f"{r['wins']}/{r['ties']}/{r['losses']}",
                f"{r['wins_with_repeat_repaired_pct']:.0f} %",
            ]
        cells += [str(r["h_max"]), " / ".join(f"{e:.2f}" for e in r["mean_entropy"])]
        cells.append(" / ".join(f"{r['oracle_tau'][k]:.2f}" for k in (1, 4, 8, 16)))
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"Correlation of h_max with τ across categories: {summary['h_max_tau_correlation']:.2f}")
    lines.append("")
    lines += [f"![{f}]({f})" for f in files]
    return "\n".join(lines) + "\n"


@torch.no_grad()
def rescorer_overhead(model, tokenizer, rows: list[dict], rescorers: dict, h: int = 8, k: int = 16) -> dict:
    """Median / p90 milliseconds per rescoring call on k x h lattices. The lattices are the base model's
    own next-token distributions at h consecutive answer positions (what ideal heads would propose), one
    per 8 answer tokens of each row's greedy answer, with the accepted text as context."""
    import statistics
    import time

    from ..io.models import chat_inputs

    cases = []
    for row in rows:
        inputs = chat_inputs(tokenizer, [{"role": "user", "content": row["turns"][0]}])
        ids = model.generate(**inputs, do_sample=False, max_new_tokens=64)[0]
        logits = model(ids[None]).logits[0]
        p = inputs["input_ids"].shape[1]
        for t in range(p, ids.numel() - h, 8):
            cases.append((Lattice.from_logits(logits[t : t + h][None], k), ids[None, : t + 1]))
    out = {}
    for name, rescorer in rescorers.items():
        if hasattr(rescorer, "bind"):
            rescorer.bind(model)
        rescorer(*cases[0])  # warm-up (first-use loading)
        times = []
        for lattice, context in cases:
            t0 = time.perf_counter()
            rescorer(lattice, context)
            times.append(time.perf_counter() - t0)
        times.sort()
        out[name] = {
            "median_ms": 1000 * statistics.median(times),
            "p90_ms": 1000 * times[int(0.9 * (len(times) - 1))],
            "calls": len(times),
            "h": h,
            "k": k,
        }
        print(name, json.dumps(out[name]))
    return out


def main(argv: list[str] | None = None) -> int:
    from ..io.models import chat_inputs, load_model
    from .bench import DEFAULT_DATA, check_data_file, environment, read_prompts, select_rows

    parser = argparse.ArgumentParser(prog="hf-bpd analyze", description=__doc__.split("\n\n")[0])
    parser.add_argument("data", nargs="?", default=DEFAULT_DATA, help="prompts jsonl (default: bundled demo prompts)")
    parser.add_argument(
        "--model", default="packaged", help="'packaged' (SmolLM2), another packaged model (gemma-3-270m), or a path"
    )
    parser.add_argument("--heads", default="packaged", help="heads folder or 'packaged' (the model's shipped heads)")
    parser.add_argument("--rescorer", default="best", help="shipped rescorer name to compare ('none': skip)")
    parser.add_argument("--spread", type=int, default=26)
    parser.add_argument("--per-category", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument(
        "--answers",
        default=None,
        help="greedy answers cache of `hf-bpd replay` (jsonl) to take first-turn answers from instead of "
        "generating them; refused if it was written for another --max-new-tokens",
    )
    parser.add_argument("--output", required=True, help="folder for report.md, analysis.json and the plots")
    parser.add_argument(
        "--overhead", action="store_true", help="only time the shipped rescorers on k=16, h=8 lattices (overhead.json)"
    )
    args = parser.parse_args(argv)
    check_data_file(args.data)

    from ..drafting.drafter import BlockDrafter
    from ..io.packaged import (
        check_shipped_rescorers,
        load_packaged_drafter,
        packaged_rescorer,
        packaged_rescorers,
        resolve_packaged_name,
    )

    packaged = resolve_packaged_name(args.model)
    if packaged is None and args.heads == "packaged":
        raise SystemExit(f"{args.model} is not a packaged model: pass the heads trained for it (--heads FOLDER)")
    if packaged is None and args.rescorer != "none":
        raise SystemExit(f"shipped rescorers are for the packaged models, not {args.model}: pass --rescorer none")
    if not args.overhead and args.rescorer != "none":
        try:  # before the model loads
            check_shipped_rescorers([args.rescorer], packaged)
        except ValueError as err:
            raise SystemExit(str(err)) from None
    rows = select_rows(read_prompts(args.data), None, args.per_category, None, args.spread)
    env = environment("cpu", "float32")  # before the run writes anything
    answers = None
    if args.answers is not None:
        from .replay import read_answers

        header, answers = read_answers(args.answers)
        if (header or {}).get("max_new_tokens") != args.max_new_tokens:
            raise SystemExit(f"{args.answers} holds answers of another length than --max-new-tokens")
        if (header or {}).get("model") != args.model:
            raise SystemExit(f"{args.answers} holds answers of {(header or {}).get('model')!r}, not of {args.model!r}")
        missing = [r.get("question_id") for r in rows if (r.get("question_id"), 0) not in answers]
        if missing:
            raise SystemExit(f"{args.answers} has no first-turn answer for question ids {missing[:10]}")
    model, tokenizer = load_model(args.model)
    if args.overhead:
        names = sorted(packaged_rescorers(packaged))
        rescorers = {n: packaged_rescorer(n, tokenizer, model=packaged) for n in names}
        timings = rescorer_overhead(model, tokenizer, rows, rescorers)
        Path(args.output).mkdir(parents=True, exist_ok=True)
        (Path(args.output) / "overhead.json").write_text(json.dumps(timings, indent=2))
        return 0
    if args.heads == "packaged":
        drafter = load_packaged_drafter(model=packaged)
    else:
        top_k = load_packaged_drafter(model=packaged).top_k if packaged is not None else 10
        drafter = BlockDrafter.from_pretrained(args.heads, top_k=top_k)
    drafter.heads.bind(model)
    rescorer = None
    if args.rescorer != "none":
        rescorer = packaged_rescorer(args.rescorer, tokenizer, model=packaged)
        if hasattr(rescorer, "bind"):
            rescorer.bind(model)
    per_category: dict[str, list[dict]] = defaultdict(list)
    from tqdm import tqdm

    for row in tqdm(rows, desc="analyze"):
        inputs = chat_inputs(tokenizer, [{"role": "user", "content": row["turns"][0]}])
        prompt_ids = inputs["input_ids"][0].tolist()
        if answers is not None:
            answer = answers[(row.get("question_id"), 0)]
        else:
            out = model.generate(**inputs, do_sample=False, max_new_tokens=args.max_new_tokens)
            answer = out[0, len(prompt_ids) :].tolist()
        per_category[row["category"]].append(analyze_row(model, drafter, rescorer, prompt_ids, answer))
    summary = summarise(per_category, drafter.num_heads)
    out_dir = Path(args.output)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = plot(summary, out_dir)
    for r in summary["categories"].values():
        del r["entropy_samples"]
    summary["args"] = vars(args)
    summary["environment"] = env
    summary["rows"] = len(rows)
    (out_dir / "analysis.json").write_text(json.dumps(summary, indent=2))
    report = markdown(summary, files)
    (out_dir / "report.md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
