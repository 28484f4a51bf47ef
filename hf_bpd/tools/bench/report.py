"""What a bench run reports: per-method totals and summaries (speedups over the fastest plain method of the
run), the markdown tables, the plot, the environment a result file records, and the files written beside
`--output`."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass
class MethodTotals:
    tokens: int = 0
    forwards: int = 0
    seconds: float = 0.0
    greedy_seconds: float = 0.0  # the reference's (plain eager greedy or sampling) time on the same turns
    baseline_seconds: float = 0.0  # the fastest plain method's time on the same turns (`summarize`)
    baseline: str | None = None  # its name
    identical: bool = True
    turns: int = 0
    identical_turns: int = 0  # turns whose output equals greedy's (the mismatch rate in low precision)
    step_times: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    steps: int = 0
    nll: float = 0.0  # sampled runs: the answers' summed negative log-likelihood under the base model
    nll_tokens: int = 0

    def add(self, record: dict, baseline_seconds: float | None = None) -> None:
        """One method's result on one turn (a `run_bench` record); `baseline_seconds`: the baseline
        method's time on the same turn (default: the reference's)."""
        self.tokens += record["tokens"]
        self.forwards += record["forwards"]
        self.seconds += record["seconds"]
        self.greedy_seconds += record["greedy_seconds"]
        self.baseline_seconds += record["greedy_seconds"] if baseline_seconds is None else baseline_seconds
        self.identical &= record["identical"]
        self.turns += 1
        self.identical_turns += bool(record["identical"])
        self.steps += record.get("steps", 0)  # hf_bpd's per-phase seconds, summed over its steps
        for k, v in record.get("step_seconds", {}).items():
            self.step_times[k] += v
        if "nll" in record:
            self.nll += record["nll"]
            self.nll_tokens += record["tokens"]

    def summary(self) -> dict:
        out = {
            "tau": self.tokens / max(self.forwards, 1),
            "tokens_per_s": self.tokens / max(self.seconds, 1e-9),
            "speedup": self.baseline_seconds / max(self.seconds, 1e-9),
            "speedup_over": self.baseline,
            "speedup_vs_reference": self.greedy_seconds / max(self.seconds, 1e-9),
            "identical": self.identical,
            "turns": self.turns,
            "identical_turns": self.identical_turns,
            "tokens": self.tokens,
            "forwards": self.forwards,
            "seconds": self.seconds,
        }
        if self.steps:
            out["ms_per_step"] = {k: 1000 * v / self.steps for k, v in self.step_times.items()}
        if self.nll_tokens:
            out["nll_per_token"] = self.nll / self.nll_tokens
        return out


# plain `generate`: eager, on fast_cpu's kernels, compiled, or on a static cache (compiled by generate on a GPU)
PLAIN_METHODS = (
    "greedy",
    "sample",
    "greedy_fast",
    "sample_fast",
    "greedy_compiled",
    "sample_compiled",
    "greedy_static",
    "greedy_static_fast",
    "greedy_static_compiled",
    "sample_static_compiled",
    "sample_static_fast",
    "sample_static",
)


def turn_key(record: dict) -> tuple:
    return record.get("question_id"), record["row"], record["turn"]


def fastest_plain(records: list[dict], methods: list[str]) -> str:
    """The plain method with the least total time over `records` (the reference when it is the only one)."""
    plain = [m for m in methods if m in PLAIN_METHODS] or methods[:1]
    return min(plain, key=lambda m: sum(r["seconds"] for r in records if r["method"] == m))


def summarize(records: list[dict], methods: list[str]) -> dict:
    """Per method, overall and per category summaries of `run_bench` records. Speedups divide by the
    fastest plain method of the run (`PLAIN_METHODS`): overall, the one fastest over all turns; in a
    category, the one fastest in that category. Each summary names it (`speedup_over`) and keeps the
    ratio over the reference beside it (`speedup_vs_reference`)."""
    seconds = {(r["method"], turn_key(r)): r["seconds"] for r in records}
    overall_base = fastest_plain(records, methods)
    category_base = {
        cat: fastest_plain([r for r in records if r["category"] == cat], methods)
        for cat in {r["category"] for r in records}
    }
    totals = {m: {"overall": MethodTotals(baseline=overall_base), "categories": {}} for m in methods}
    for r in records:
        cat = r["category"]
        categories = totals[r["method"]]["categories"]
        if cat not in categories:
            categories[cat] = MethodTotals(baseline=category_base[cat])
        totals[r["method"]]["overall"].add(r, seconds.get((overall_base, turn_key(r))))
        categories[cat].add(r, seconds.get((category_base[cat], turn_key(r))))
    return {
        name: {
            "overall": t["overall"].summary(),
            "categories": {c: s.summary() for c, s in sorted(t["categories"].items())},
        }
        for name, t in totals.items()
    }


def round_speedups(records: list[dict], methods: list[str]) -> dict[str, dict[str, list[float]]]:
    """Of a batch run's records (`batch.run_batch_bench`): per batch size ("batches of B") and
    method, each round's speedup on its own: the seconds of that size's fastest plain method (over all
    rounds) over the method's, summed over the round's batches. How far the rounds spread is the host's
    noise at that size, beside the speedup over all rounds."""
    out: dict[str, dict[str, list[float]]] = {}
    for category in sorted({r["category"] for r in records}):
        of_size = [r for r in records if r["category"] == category]
        base = fastest_plain(of_size, methods)
        seconds: dict[tuple[str, int], float] = {}
        for r in of_size:
            seconds[r["method"], r["round"]] = seconds.get((r["method"], r["round"]), 0.0) + r["seconds"]
        rounds = sorted({k for _, k in seconds})
        out[category] = {m: [seconds[base, k] / seconds[m, k] for k in rounds] for m in methods}
    return out


def drafted_step_share(records: list[dict]) -> dict[str, dict[str, float]]:
    """Of a batch run's records: per batch size and drafting method, the share of its decoding steps that
    drafted (the rest were plain steps the step chooser took where drafting did not pay)."""
    out: dict[str, dict[str, float]] = {}
    for r in records:
        if "steps" in r:
            steps, plain = out.setdefault(r["category"], {}).get(r["method"], (0, 0))
            out[r["category"]][r["method"]] = (steps + r["steps"], plain + r["plain_steps"])
    return {c: {m: (s - p) / s if s else 0.0 for m, (s, p) in by.items()} for c, by in out.items()}


def markdown_table(results: dict) -> str:
    """Three tables: τ and speedup per category (one column per method), then per method overall τ,
    tokens/s, speedup, lossless flag and hf_bpd's time per step by phase."""
    methods = list(results)
    cats = list(next(iter(results.values()))["categories"])
    lines = []
    for key, unit in (("tau", "τ"), ("speedup", "speedup")):
        lines += [
            "| category | " + " | ".join(f"{m} {unit}" for m in methods) + " |",
            "|" + " --- |" * (1 + len(methods)),
        ]
        for cat in [*cats, "overall"]:
            cells = []
            for m in methods:
                s = results[m]["overall"] if cat == "overall" else results[m]["categories"][cat]
                cells.append(f"{s[key]:.2f}" + ("×" if key == "speedup" else "") + ("" if s["identical"] else " ✗"))
            name = f"**{cat}**" if cat == "overall" else cat
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    lines.pop()
    phases = ["heads", "rescore", "lattice_tree", "verify_forward", "accept", "cache_compaction"]
    lines += ["", "| method | τ | tok/s | speedup | identical | " + " | ".join(f"{p} ms" for p in phases) + " |"]
    lines.append("|" + " --- |" * (5 + len(phases)))
    for m in methods:
        s = results[m]["overall"]
        steps = s.get("ms_per_step", {})
        times = [f"{steps[p]:.1f}" if p in steps else "" for p in phases]
        lines.append(
            f"| {m} | {s['tau']:.2f} | {s['tokens_per_s']:.2f} | {s['speedup']:.2f}× | "
            f"{_identical_cell(s)} | " + " | ".join(times) + " |"
        )
    lines += ["", baseline_line(results)]
    if all("nll_per_token" in results[m]["overall"] for m in methods):
        lines += ["", "| method | answers' NLL per token under the base model (T = 1) |", "| --- | --- |"]
        lines += [f"| {m} | {results[m]['overall']['nll_per_token']:.3f} |" for m in methods]
    return "\n".join(lines)


def baseline_line(results: dict) -> str:
    """What the speedups of `results` divide by, in words."""
    first = next(iter(results.values()))
    overall = first["overall"].get("speedup_over")
    if overall is None:  # result files from before the fastest-plain rule: plain eager greedy
        return "Speedup: over plain greedy `generate` (eager kernels; this run had no fast-kernel baseline)."
    by_category = {c: s["speedup_over"] for c, s in first["categories"].items()}
    others = sorted(c for c, b in by_category.items() if b != overall)
    where = f"; in {', '.join(others)}: {', '.join(sorted({by_category[c] for c in others}))}" if others else ""
    static = (
        "; `_static`: a static cache, which generate compiles with CUDA graphs on a GPU"
        if any(m.endswith("_static") for m in results)
        else ""
    )
    return (
        f"Speedup: over the fastest plain `generate` of the run, per category and overall: {overall}{where} "
        f"(`_fast`: on hf_bpd.fast_cpu's kernels; `_compiled`: torch.compile with inductor freezing{static})."
    )


def _identical_cell(summary: dict) -> str:
    if summary["identical"]:
        return "yes"
    if "turns" in summary:  # summaries from before the count say only NO
        return f"NO ({summary['turns'] - summary['identical_turns']} of {summary['turns']} turns differ)"
    return "NO"


def plot(results: dict, path: str | Path) -> None:
    """Grouped bars per category (and overall), one bar per method: τ on top, speedup over greedy below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(results)
    cats = [*next(iter(results.values()))["categories"], "overall"]
    fig, axes = plt.subplots(2, 1, figsize=(max(8.0, 0.3 * len(cats) * len(methods) + 2), 6), sharex=True)
    width = 0.8 / len(methods)
    for ax, key, label in ((axes[0], "tau", "τ (tokens / forward)"), (axes[1], "speedup", "speedup over greedy")):
        for j, m in enumerate(methods):
            values = [(results[m]["overall"] if c == "overall" else results[m]["categories"][c])[key] for c in cats]
            ax.bar([i - 0.4 + width * (j + 0.5) for i in range(len(cats))], values, width, label=m)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_ylabel(label)
    axes[0].legend(ncol=min(len(methods), 4), fontsize="small")
    axes[1].set_xticks(range(len(cats)), cats, rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine(device: str) -> str:
    """The machine a run is timed on: for a CPU its processor's model, cores and threads, since timings
    (and which plain method is fastest) differ between processor kinds; otherwise the device's name."""
    from ...disk_cache import device_name

    dev = torch.device(device)
    if dev.type != "cpu":
        return device
    return f"cpu ({device_name(dev)}, {os.cpu_count()} cores, {torch.get_num_threads()} threads)"


def environment(device: str, dtype: str) -> dict:
    """What a result file needs to say where it came from: date, device (the processor's model for a CPU),
    library versions and the commit of the code that ran (None outside a git checkout). Take it when a run
    starts: once a run has rewritten its own committed result files, the tree reads as uncommitted."""
    import subprocess

    import transformers

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=Path(__file__).parent
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).parent,
        ).stdout.strip()
        commit += "+uncommitted changes" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        commit = None
    dev = torch.device(device)
    return {
        "date": datetime.date.today().isoformat(),
        "device": machine(device),
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
        "commit": commit,
        "dtype": dtype,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def write_result_files(output: str | Path, report: dict, table: str) -> None:
    """`report` as JSON at `output` and `table` as Markdown beside it (`.md`), its folder made if needed."""
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    Path(output).write_text(json.dumps(report, indent=2))
    Path(output).with_suffix(".md").write_text(table + "\n")


def write_report(results: dict, info: dict, output: str | None, sampled: bool = False) -> int:
    """Print the tables; write JSON (`info` + results), .md and .png beside `output`; 1 if a greedy run
    was not lossless (sampled runs report how many turns match the seeded plain sampling: hf_bpd draws
    as it does, up to rounding, other methods draw differently)."""
    report = {**info, "methods": results}
    table = markdown_table(results)
    print(table)
    if output:
        write_result_files(output, report, table)
        try:
            plot(results, Path(output).with_suffix(".png"))
        except ImportError:
            print("matplotlib is not installed: no plot (pip install hf_bpd[analysis])", file=sys.stderr)
    bad = [m for m, r in results.items() if not r["overall"]["identical"]]
    if bad and not sampled:
        print(f"NOT LOSSLESS: {bad} differ from greedy", file=sys.stderr)
        return 1
    return 0
