"""Where a drafting method's time goes, against the fastest plain method of the same bench run.

    python -m research.speed_budget benchmarks/speed/fastest_plain_dev_amd.journal.jsonl \
        --output benchmarks/speed/fastest_plain_dev_amd_budget.json

Reads only the run's journal (no timing, so nothing else has to be idle). For each method that drafts
(its records carry `step_seconds`), over the turns every method finished:
- its speedup over the fastest plain method of those turns (as `hf-bpd bench` computes it), and τ;
- a verification forward's cost in plain tokens: ms per verify forward / the plain method's ms per token.
  τ over that ratio is the speedup the method would reach if drafting, acceptance, cache compaction and
  the prefill cost nothing beyond plain's;
- each phase's share of its time (per step: heads, rescore, lattice_tree, verify_forward, accept,
  cache_compaction; per turn: the rest, i.e. the prefill and the loop between steps), and the speedup the
  method would reach if that one phase cost nothing (the others as measured).
So the gap to a goal is split into the kernel (the verify ratio) and the overheads, from one run's own
timings.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from hf_bpd.tools.bench import environment, fastest_plain, load_journal, merged_environment, turn_key

PHASES = ("heads", "rescore", "lattice_tree", "verify_forward", "accept", "cache_compaction")


def budget(records: list[dict], methods: list[str]) -> dict:
    """The budget of every drafting method among `records` (one bench journal's), over the turns every
    method finished."""
    per_turn = Counter(turn_key(r) for r in records)
    complete = {t for t, n in per_turn.items() if n == len(methods)}
    records = [r for r in records if turn_key(r) in complete]
    totals = {m: {"tokens": 0, "seconds": 0.0, "forwards": 0} for m in methods}
    for r in records:
        t = totals[r["method"]]
        t["tokens"] += r["tokens"]
        t["seconds"] += r["seconds"]
        t["forwards"] += r["forwards"]
    base = fastest_plain(records, methods)  # as `hf-bpd bench` picks it
    per_token = totals[base]["seconds"] / totals[base]["tokens"]  # the plain method's seconds per token
    out = {"turns": len(complete), "fastest_plain": base, "plain_ms_per_token": 1000 * per_token, "methods": {}}
    for m in methods:
        drafted = [r for r in records if r["method"] == m and "step_seconds" in r]
        if not drafted:
            continue
        tokens, seconds = totals[m]["tokens"], totals[m]["seconds"]
        steps = sum(r["steps"] for r in drafted)
        phase = {p: sum(r["step_seconds"].get(p, 0.0) for r in drafted) for p in PHASES}
        phase["prefill_and_loop"] = seconds - sum(phase.values())
        ideal = tokens * per_token  # the plain method's time for these tokens
        verify_ratio = phase["verify_forward"] / steps / per_token
        out["methods"][m] = {
            "tokens": tokens,
            "steps": steps,
            "tau": tokens / totals[m]["forwards"],
            "speedup": ideal / seconds,
            "ms_per_step": {p: 1000 * phase[p] / steps for p in PHASES},
            "prefill_and_loop_ms_per_turn": 1000 * phase["prefill_and_loop"] / len(complete),
            "verify_in_plain_tokens": verify_ratio,
            "tau_over_verify_ratio": (tokens / steps) / verify_ratio,
            "share": {p: v / seconds for p, v in phase.items()},
            "speedup_without": {p: ideal / (seconds - v) for p, v in phase.items() if p != "verify_forward"},
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m research.speed_budget", description=__doc__.split("\n\n")[0])
    parser.add_argument("journal")
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    header, records = load_journal(Path(args.journal))
    if header is None:
        parser.error(f"{args.journal}: no bench journal there")
    report = {
        "journal": args.journal,
        "environment": environment("cpu", "float32"),  # this analysis: its commit and date
        # the run's, from its JSON report beside the journal (None while the run goes on)
        "run_environment": merged_environment([args.journal]).get("environment"),
        **budget(records, header["methods"]),
    }
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
