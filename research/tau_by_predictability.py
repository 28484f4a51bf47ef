"""Why sampled τ falls short of greedy τ: the drafter's τ per answer, grouped by how predictable the
answer is to the base model.

A sampled bench run with the `hf_bpd_greedy` method (`hf-bpd bench --do-sample ... --methods ... hf_bpd
hf_bpd_greedy`) decodes every turn twice with the same drafter: once drawing as plain sampling does, once
greedily. Its journal records each answer's negative log-likelihood under the base model (at T = 1). Two
things can lower sampled τ: the acceptance rule (a drafted child is accepted when the draw lands on it,
not when it is the argmax) and the text itself (greedy answers may be more predictable). Grouping
turns by NLL per token separates them: within one group, the text is about as predictable for both, so
what is left is the rule.

    python -m research.tau_by_predictability benchmarks/sampling/t07_dev.journal.jsonl \
        --output benchmarks/sampling/t07_dev_by_nll.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from hf_bpd.tools.bench import load_journal, merged_environment

EDGES = (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, math.inf)  # NLL per token, nats


def _group(records: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in records)
    forwards = sum(r["forwards"] for r in records)
    nll = sum(r["nll"] for r in records)
    return {
        "turns": len(records),
        "tokens": tokens,
        "tau": tokens / forwards if forwards else None,
        "nll_per_token": nll / tokens if tokens else None,
    }


def by_predictability(records: list[dict], sampled: str = "hf_bpd", greedy: str = "hf_bpd_greedy") -> dict:
    """{"overall": {method: group}, "buckets": [{"nll_range": [lo, hi], method: group, ...}]} for the
    sampled and greedy methods of a journal's records (turns without tokens are left out)."""
    ranges = [[lo, hi if hi < math.inf else None] for lo, hi in zip(EDGES, EDGES[1:])]  # None: no upper bound
    out: dict = {"overall": {}, "buckets": [{"nll_range": r} for r in ranges]}
    for method in (sampled, greedy):
        mine = [r for r in records if r["method"] == method and r["tokens"] > 0]
        if not mine:
            raise SystemExit(f"the journal has no records of {method!r}")
        out["overall"][method] = _group(mine)
        for bucket in out["buckets"]:
            lo, hi = bucket["nll_range"]
            bucket[method] = _group([r for r in mine if lo <= r["nll"] / r["tokens"] < (hi or math.inf)])
    out["matched"] = matched(out["buckets"], sampled, greedy)
    return out


def matched(buckets: list[dict], sampled: str, greedy: str) -> dict:
    """Greedy τ on text as predictable as the sampled answers: in the buckets both methods fill, the
    forwards greedy decoding needs per token in each bucket, spent on the sampled answers' tokens there.
    Its ratio to sampled τ in the same buckets is what the acceptance rule costs."""
    both = [b for b in buckets if b[sampled]["turns"] and b[greedy]["turns"]]
    tokens = sum(b[sampled]["tokens"] for b in both)
    sampled_forwards = sum(b[sampled]["tokens"] / b[sampled]["tau"] for b in both)
    greedy_forwards = sum(b[sampled]["tokens"] / b[greedy]["tau"] for b in both)
    return {
        "sampled_tokens_covered": tokens,
        "sampled_tau": tokens / sampled_forwards,
        "greedy_tau_at_sampled_mix": tokens / greedy_forwards,
        "ratio": greedy_forwards / sampled_forwards,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("journal", help="a sampled bench run's journal with hf_bpd and hf_bpd_greedy")
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    header, records = load_journal(Path(args.journal))
    if header is None:
        raise SystemExit(f"{args.journal}: no bench journal there")
    environment = merged_environment([args.journal]).get("environment")  # from the run's report beside it
    report = {"journal": args.journal, "environment": environment, "decoding": header.get("decoding")}
    report.update(by_predictability(records))
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    for bucket in report["buckets"]:
        print(json.dumps(bucket))
    print(json.dumps(report["overall"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
