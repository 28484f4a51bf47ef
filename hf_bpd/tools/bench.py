"""`hf-bpd bench`: Spec-Bench-format prompts, several decoding methods in ONE process, interleaved per
prompt so machine drift hits every method alike.

Per category and overall: tau (new tokens / base-model forwards; 1.00 for greedy), tokens/s, speedup over
the FASTEST plain `generate` of the run on the same prompts (plain greedy, or plain greedy on
`hf_bpd.fast_cpu`'s kernels, whichever was faster in that category, or overall), and whether every output
equals plain greedy's (the run exits 1 if one does not).
MT-bench rows: the second turn is asked after greedy's own first answer (the same input for every
method; a lossless method gives that answer too).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..cpu.packed_linear import fast_cpu
from ..decode.binding import binding_of, prepare
from ..decode.cost import ForwardCost, measure_forward_cost
from ..decode.support import attention_windows
from ..drafting.drafter import BlockDrafter
from ..generation import generate as bpd_generate
from ..io.jsonl import read_jsonl
from ..io.models import chat_inputs
from .forward_counter import ForwardCounter

DEFAULT_DATA = "../shared/data/spec_bench_dev.jsonl"


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


@torch.no_grad()
def answer_nll(model, sequence: torch.Tensor, prompt_length: int) -> float:
    """Summed negative log-likelihood of the answer `sequence[0, prompt_length:]` under the base model's
    raw distribution (temperature 1): the quality measure of sampled runs, where outputs differ by method
    and a lossy acceptance rule would show as a shift from plain sampling's value."""
    logits = model(sequence).logits[0, prompt_length - 1 : -1].float()
    answer = sequence[0, prompt_length:]
    return float(torch.nn.functional.cross_entropy(logits, answer, reduction="sum"))


@dataclass
class Method:
    """A decoding method: `run(inputs, max_new_tokens) -> (sequences, stats or None)`; hf_bpd methods keep
    their drafter (for what it learned during the run)."""

    name: str
    run: Callable
    drafter: BlockDrafter | None = None


GREEDY = {"do_sample": False}
STATIC = {"cache_implementation": "static"}  # generate's static cache (compiled with CUDA graphs on a GPU)


def reference_name(decoding: dict) -> str:
    """The reference method's name: plain `generate` greedy ("greedy") or sampling ("sample")."""
    return "sample" if decoding.get("do_sample") else "greedy"


def greedy_method(model, decoding: dict = GREEDY) -> Method:
    """Plain `generate` with the run's decoding settings (greedy, or sampling options): the reference."""
    return Method(
        reference_name(decoding), lambda inputs, n: (model.generate(**inputs, **decoding, max_new_tokens=n), None)
    )


def static_cache_method(model, decoding: dict = GREEDY) -> Method:
    """Plain `generate` on a static cache (named `<reference>_static`): on a GPU `generate` compiles its
    decoding there (CUDA graphs), its fastest plain decoding; a plain method like the others."""
    return Method(f"{reference_name(decoding)}_static", greedy_method(model, {**decoding, **STATIC}).run)


def fast_cpu_method(method: Method, model) -> Method:
    """`method` with every forward of `model` on `hf_bpd.fast_cpu`'s kernels (named `<name>_fast`): the
    kernels hf_bpd's own forwards use, given to the baselines too. The kernel plan is measured (or read
    from the cache) here, before any timing."""
    try:
        block = fast_cpu(model)
    except (ValueError, RuntimeError) as err:
        raise SystemExit(f"{method.name}_fast runs on hf_bpd.fast_cpu's CPU kernels: {err}") from None

    def run(inputs, n):
        with block:
            return method.run(inputs, n)

    return Method(f"{method.name}_fast", run)


def compiled_method(method: Method, model, tokenizer) -> Method:
    """`method` with the model's forward compiled by `torch.compile` (inductor with freezing: the weights
    become constants, packed for the CPU; dynamic shapes), named `<name>_compiled`: the other fast plain
    baseline. Compiled here, on two warm-up prompts of different lengths (the second compiles the dynamic
    graph), before any timing; compilation is a one-time cost the run reports apart, not in tokens/s."""
    import torch._dynamo.config as dynamo
    import torch._inductor.config as inductor

    inductor.freezing = True
    # every compiled method of the run shares model.forward's code object, whose graphs count against one
    # limit (8 by default; past it dynamo runs new shapes eagerly, unreported): plain greedy's prefill and
    # step, and hf_bpd's one-token and tree forwards, cost curve and cropped caches
    dynamo.recompile_limit = max(dynamo.recompile_limit, 64)
    compiled = torch.compile(model.forward, dynamic=True)

    def run(inputs, n):
        model.forward = compiled  # for this call only: an instance attribute, removed after
        try:
            return method.run(inputs, n)
        finally:
            del model.forward

    device = next(model.parameters()).device
    short, longer = (
        chat_inputs(tokenizer, [{"role": "user", "content": text}], device)
        for text in ("Hi.", "Say hello to the world in three different languages, please.")
    )
    windowed = window_warm_up(model, tokenizer, device)
    t0 = time.perf_counter()
    # long enough for a drafted method to meet its shapes (tree sizes, a compacted cache) before timing
    for inputs, new_tokens in [(short, 32), (longer, 32), *windowed]:
        run(inputs, new_tokens)
    if method.drafter is not None:
        # a drafted method's plain steps (one token on a cache) are a graph of their own, which a decode meets
        # only where drafting stops paying: compiled here, not inside a timed turn
        tree_size, method.drafter.max_tree_tokens = method.drafter.max_tree_tokens, 1
        try:
            for inputs, new_tokens in [(longer, 8), *windowed]:
                run(inputs, new_tokens)
        finally:
            method.drafter.max_tree_tokens = tree_size
    COMPILE_SECONDS[f"{method.name}_compiled"] = time.perf_counter() - t0
    return Method(f"{method.name}_compiled", run)


COMPILE_SECONDS: dict[str, float] = {}  # one-time compilation of the `_compiled` methods of this process


def window_warm_up(model, tokenizer, device) -> list[tuple[dict, int]]:
    """Warm-up decodes for a compiled model with attention windows, as (inputs, new tokens): transformers'
    masks branch on whether the keys reach a window, and the compiled forward guards on it, so for each
    window a decode that crosses it and a prompt past it need graphs of their own (met in a timed turn,
    they would be compiled there). Empty for a model without windows."""
    windows = attention_windows(model)
    if windows is None or not windows.layers:
        return []
    sizes = sorted({size for _, size in windows.layers.values()})
    text = "Tell me about the history of the world, one century at a time. " * (sizes[-1] // 4 + 16)
    inputs = chat_inputs(tokenizer, [{"role": "user", "content": text}], device)
    if inputs["input_ids"].shape[1] < sizes[-1] + 16:
        raise RuntimeError(f"a window warm-up prompt of {inputs['input_ids'].shape[1]} tokens, under {sizes[-1] + 16}")

    def first(n: int) -> dict:
        return {k: v[:, :n] for k, v in inputs.items()}

    return [decode for size in sizes for decode in ((first(max(size - 16, 1)), 32), (first(size + 16), 8))]


def prompt_lookup_method(model, num_tokens: int = 10, decoding: dict = GREEDY) -> Method:
    """transformers' prompt-lookup decoding: drafts copied from n-gram matches in the prompt."""

    def run(inputs, n):
        return model.generate(**inputs, **decoding, max_new_tokens=n, prompt_lookup_num_tokens=num_tokens), None

    return Method("prompt_lookup", run)


def assisted_method(model, assistant_model, name: str = "assisted", decoding: dict = GREEDY) -> Method:
    """transformers' assisted generation with a small draft LM sharing the tokenizer."""

    def run(inputs, n):
        return model.generate(**inputs, **decoding, max_new_tokens=n, assistant_model=assistant_model), None

    return Method(name, run)


def bpd_method(model, drafter: BlockDrafter, name: str = "hf_bpd", decoding: dict = GREEDY) -> Method:
    # One-time start-up work (binding the heads, measuring the forward-cost curve for "auto" trees) is
    # done here, like model loading, so it is neither timed nor counted as decoding forwards.
    prepare(drafter, model)

    def run(inputs, n):
        out = model.generate(**inputs, **decoding, max_new_tokens=n, custom_generate=bpd_generate, assistant=drafter)
        return out, drafter.stats

    return Method(name, run, drafter)


def greedy_bpd_method(model, drafter: BlockDrafter) -> Method:
    """hf_bpd decoding greedily inside a sampled run: the greedy τ of the same drafter on the same turns
    (later turns continue the reference's sampled answers), which sampling's τ is measured against. Its
    drafter is a copy with the same heads and settings, so that its calibration is greedy's own; its
    tokens are greedy's, so it is not expected to match the sampled reference."""
    return bpd_method(model, drafter.with_rescorer(drafter.rescorer), "hf_bpd_greedy", GREEDY)


def learned(methods: list[Method]) -> dict:
    """What each calibrated hf_bpd method's drafter learned so far: acceptance multipliers per
    source@depth and forward-cost factors per tree-size bucket."""
    return {
        m.name: {
            "acceptance_multipliers": m.drafter.calibration.summary(),
            "forward_cost_factors": getattr(binding_of(m.drafter).step_cost, "factors", {}),
        }
        for m in methods
        if m.drafter is not None and m.drafter.calibration is not None
    }


def select_rows(
    rows: list[dict],
    categories: list[str] | None,
    per_category: int | None,
    limit: int | None,
    spread: int | None = None,
) -> list[dict]:
    """Filter by category, keep the first `per_category` of each, or `spread` rows evenly spaced over the
    file (every len/spread-th row: all categories represented), then the first `limit`."""
    if categories:
        unknown = set(categories) - {r["category"] for r in rows}
        if unknown:
            raise SystemExit(f"unknown categories: {sorted(unknown)}")
        rows = [r for r in rows if r["category"] in categories]
    if per_category:
        seen: dict[str, int] = defaultdict(int)
        kept = []
        for r in rows:
            if seen[r["category"]] < per_category:
                kept.append(r)
                seen[r["category"]] += 1
        rows = kept
    if spread:
        rows = rows[:: max(len(rows) // spread, 1)][:spread]
    return rows[:limit] if limit else rows


def run_bench(
    model,
    tokenizer,
    rows: list[dict],
    methods: list[Method],
    max_new_tokens: int,
    progress: bool = True,
    journal: str | Path | None = None,
    header: dict | None = None,
    seed: int | None = None,
) -> dict:
    """Run every method on every turn of every row (greedy first: it is the reference and gives the
    MT-bench first answers). Returns {method: {"overall": summary, "categories": {cat: summary}}}.

    seed: for sampling runs, every method of a turn starts from `torch.manual_seed(seed + turn number)`,
    so hf_bpd, which draws exactly as plain sampling does, can be compared token for token.

    journal: a jsonl file that gets `header` and then each finished row's records (one per turn and
    method), flushed row by row; a rerun with the same journal and header skips the rows already there
    (resume after an interruption) and aggregates them with the new ones."""
    from tqdm import tqdm

    names = [m.name for m in methods]
    header = {**(header or {}), "methods": names, "max_new_tokens": max_new_tokens, "rows": len(rows)}
    done = {}
    if journal is not None:  # rows whose every turn has every method's record
        for i, records in read_journal(journal, header).items():
            if i >= len(rows) or any(r["question_id"] != rows[i].get("question_id") for r in records):
                continue
            pairs = [(r["turn"], r["method"]) for r in records]
            if sorted(pairs) == sorted((t, m) for t in range(len(rows[i]["turns"])) for m in names):
                done[i] = records
        # rewrite: header + complete rows only (a row cut off mid-write is redone); atomically, so an
        # interruption now loses nothing
        Path(journal).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(journal).with_suffix(".tmp")
        tmp.write_text(
            "".join(json.dumps(x) + "\n" for x in [{"header": header}, *(r for i in sorted(done) for r in done[i])])
        )
        os.replace(tmp, journal)
    device = next(model.parameters()).device
    greedy = methods[0]
    with ForwardCounter(model) as counter:
        todo = [(i, row) for i, row in enumerate(rows) if i not in done]
        for i, row in tqdm(todo, disable=not progress, desc="bench", initial=len(done), total=len(rows)):
            records = []
            messages: list[dict] = []
            for t, turn in enumerate(row["turns"]):
                messages.append({"role": "user", "content": turn})
                inputs = chat_inputs(tokenizer, messages, device)
                n = inputs["input_ids"].shape[1]
                # interleave: rotate the order of the non-reference methods from row to row
                others = methods[1:]
                others = others[i % len(others) :] + others[: i % len(others)] if others else []
                results = {}
                for m in [greedy, *others]:
                    if seed is not None:
                        torch.manual_seed(seed + 1000 * i + t)
                    counter.count = 0
                    t0 = time.perf_counter()
                    seq, stats = m.run(inputs, max_new_tokens)
                    results[m.name] = (seq, counter.count, stats, time.perf_counter() - t0)
                    if stats is not None and stats.forwards != counter.count:
                        raise RuntimeError(
                            f"{m.name}: stats count {stats.forwards} forwards, the model ran {counter.count}"
                        )
                ref, greedy_s = results[greedy.name][0], results[greedy.name][3]
                for name in names:
                    seq, forwards, stats, secs = results[name]
                    record = {
                        "row": i,
                        "question_id": row.get("question_id"),
                        "category": row["category"],
                        "turn": t,
                        "method": name,
                        "tokens": seq.shape[1] - n,
                        "forwards": forwards,
                        "seconds": secs,
                        "greedy_seconds": greedy_s,
                        "identical": seq.tolist() == ref.tolist(),
                    }
                    if seed is not None:  # after the timing, not counted as decoding forwards
                        record["nll"] = answer_nll(model, seq, n)
                    if stats is not None:
                        record["steps"] = stats.steps
                        record["step_seconds"] = {k: v * stats.steps for k, v in stats.time_per_step().items()}
                    records.append(record)
                answer = tokenizer.decode(ref[0, n:], skip_special_tokens=True)
                messages.append({"role": "assistant", "content": answer})
            done[i] = records
            if journal is not None:
                _append(journal, records)
    return summarize([r for i in sorted(done) for r in done[i]], names)


def read_journal(path: str | Path, header: dict) -> dict[int, list[dict]]:
    """A bench journal's records by row index ({} when there is none). Raises when it was written by a
    run with other settings (its rows would not be comparable)."""
    old, records = load_journal(Path(path))
    if old is None:
        return {}
    changes = _setting_changes(old, header, RESUME_KEYS)
    if changes:
        raise ValueError(f"{path} was written with other settings ({changes}); use another --output or --overwrite")
    rows: dict[int, list[dict]] = defaultdict(list)
    for record in records:
        rows[record["row"]].append(record)
    return dict(rows)


def merge_journals(paths: list[str | Path]) -> tuple[list[str], list[dict]]:
    """(methods, records) of the finished rows of several journals of one run split by row selection
    (e.g. `--categories` per process or machine). Raises when they were written with other settings, or
    when two of them hold the same turn."""
    headers, records = [], []
    for path in paths:
        header, recs = load_journal(Path(path))
        if header is None:
            raise ValueError(f"{path}: no bench journal there")
        headers.append(header)
        records += recs
    keys = [k for k in RESUME_KEYS if k not in ("selection", "rows")]  # the parts select different rows
    for path, header in zip(paths[1:], headers[1:]):
        changes = _setting_changes(headers[0], header, keys)
        if changes:
            raise ValueError(f"{path} was written with other settings than {paths[0]} ({changes})")
    seen = Counter((r["question_id"], r["turn"], r["method"]) for r in records)
    twice = [key for key, n in seen.items() if n > 1]
    if twice:
        raise ValueError(f"the journals overlap: {len(twice)} (question, turn, method) records twice, e.g. {twice[0]}")
    return headers[0]["methods"], records


def merged_environment(journals: list[str | Path]) -> dict:
    """The environment of a merged run, from each part's JSON report beside its journal (X.journal.jsonl
    -> X.json): {"environment": the first part's, "parts": [{file, environment, forward_cost}]}. Parts
    without a report are listed without one; {} when none has one."""
    parts = []
    for journal in journals:
        report_file = Path(str(journal).removesuffix(".journal.jsonl") + ".json")
        report = json.loads(report_file.read_text()) if report_file.is_file() else {}
        header = load_journal(Path(journal))[0] or {}
        parts.append(
            {
                "file": str(report_file),
                "environment": report.get("environment"),
                "forward_cost": header.get("forward_cost"),
            }
        )
    known = [p["environment"] for p in parts if p["environment"]]
    return {"environment": known[0], "parts": parts} if known else {}


def _setting_changes(old: dict, new: dict, keys) -> str:
    """The settings among `keys` on which two journal headers differ, as "key: old vs new" ('' if none)."""
    old, new = _with_defaults(old), _with_defaults(new)
    return ", ".join(f"{k}: {old.get(k)!r} vs {new.get(k)!r}" for k in keys if old.get(k) != new.get(k))


def _with_defaults(header: dict) -> dict:
    """Settings added after a journal was written, at the value such runs had: packed_linear "off",
    context_lookup 0."""
    drafter = header.get("drafter")
    if isinstance(drafter, dict):
        added = {"packed_linear": "off", "context_lookup": 0}
        header = {**header, "drafter": {**drafter, **{k: v for k, v in added.items() if k not in drafter}}}
    return header


def load_journal(path: Path) -> tuple[dict | None, list[dict]]:
    """(header, records) of a journal file; (None, []) when there is none."""
    if not path.is_file():
        return None, []
    lines = path.read_text().splitlines()
    first = json.loads(lines[0]) if lines else {}
    if "header" not in first:
        raise ValueError(f"{path} is not a bench journal (no header line)")
    records = []
    for line in lines[1:]:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # the last line of a run killed mid-write
            continue
    return first["header"], records


# Heads are identified by content (`drafter.heads_sha1`), not by the `heads` argument: "packaged" names
# other heads once new ones are shipped, and a folder may move.
RESUME_KEYS = (
    "methods",
    "max_new_tokens",
    "rows",
    "data",
    "model",
    "selection",
    "dtype",
    "device",
    "drafter",
    "rescorer_specs",
)


def _digest(state: dict[str, torch.Tensor]) -> str:
    """A content hash of a state dict (which heads a journal was written with)."""
    h = hashlib.sha1()
    for name, tensor in sorted(state.items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _rescorer_specs(methods: list[str], model: str | None = None) -> dict:
    """The shipped specs of the rescorers the methods use for packaged `model` (the assisted method drafts
    with "neural")."""
    from ..io.packaged import packaged_rescorers

    specs = packaged_rescorers(model)
    names = [m.split("+", 1)[1] for m in methods if m.startswith("hf_bpd+")] + (["neural"] * ("assisted" in methods))
    return {n: specs.get(n) for n in names}


def _append(path: str | Path, records: list[dict]) -> None:
    with open(path, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


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
    "sample_static_fast",
    "sample_static",
)


def _turn(record: dict) -> tuple:
    return record.get("question_id"), record["row"], record["turn"]


def _fastest_plain(records: list[dict], methods: list[str]) -> str:
    """The plain method with the least total time over `records` (the reference when it is the only one)."""
    plain = [m for m in methods if m in PLAIN_METHODS] or methods[:1]
    return min(plain, key=lambda m: sum(r["seconds"] for r in records if r["method"] == m))


def summarize(records: list[dict], methods: list[str]) -> dict:
    """Per method, overall and per category summaries of `run_bench` records. Speedups divide by the
    fastest plain method of the run (`PLAIN_METHODS`): overall, the one fastest over all turns; in a
    category, the one fastest in that category. Each summary names it (`speedup_over`) and keeps the
    ratio over the reference beside it (`speedup_vs_reference`)."""
    seconds = {(r["method"], _turn(r)): r["seconds"] for r in records}
    overall_base = _fastest_plain(records, methods)
    category_base = {
        cat: _fastest_plain([r for r in records if r["category"] == cat], methods)
        for cat in {r["category"] for r in records}
    }
    totals = {m: {"overall": MethodTotals(baseline=overall_base), "categories": {}} for m in methods}
    for r in records:
        cat = r["category"]
        categories = totals[r["method"]]["categories"]
        if cat not in categories:
            categories[cat] = MethodTotals(baseline=category_base[cat])
        totals[r["method"]]["overall"].add(r, seconds.get((overall_base, _turn(r))))
        categories[cat].add(r, seconds.get((category_base[cat], _turn(r))))
    return {
        name: {
            "overall": t["overall"].summary(),
            "categories": {c: s.summary() for c, s in sorted(t["categories"].items())},
        }
        for name, t in totals.items()
    }


def round_speedups(records: list[dict], methods: list[str]) -> dict[str, dict[str, list[float]]]:
    """Of a batch run's records (`bench_batch.run_batch_bench`): per batch size ("batches of B") and
    method, each round's speedup on its own: the seconds of that size's fastest plain method (over all
    rounds) over the method's, summed over the round's batches. How far the rounds spread is the host's
    noise at that size, beside the speedup over all rounds."""
    out: dict[str, dict[str, list[float]]] = {}
    for category in sorted({r["category"] for r in records}):
        of_size = [r for r in records if r["category"] == category]
        base = _fastest_plain(of_size, methods)
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


def environment(device: str, dtype: str) -> dict:
    """What a result file needs to say where it came from: date, device (the processor's model for a CPU),
    library versions and the commit of the code that ran (None outside a git checkout). Take it when a run
    starts: once a run has rewritten its own committed result files, the tree reads as uncommitted."""
    import subprocess

    import transformers

    from ..disk_cache import device_name

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
        "device": device
        if dev.type != "cpu"
        else f"cpu ({device_name(dev)}, {os.cpu_count()} cores, {torch.get_num_threads()} threads)",
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
        "commit": commit,
        "dtype": dtype,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def check_data_file(path: str) -> None:
    """Refuse a missing prompts file before the model loads (the default is the dev half of Spec-Bench in
    the project's ../shared/data, which a user's machine does not have)."""
    if not Path(path).is_file():
        raise SystemExit(
            f"{path}: no such file. Pass a Spec-Bench-format jsonl (question_id, category, turns) as the first "
            f"argument; the default {DEFAULT_DATA} exists only beside the project's checkout"
        )


def load_drafter(heads: str, model, num_heads: int = 4, packaged_model: str | None = None, **kwargs) -> BlockDrafter:
    """The drafter a benchmark runs, profiled: `heads` is a folder, "packaged" (the heads shipped for the
    packaged model `packaged_model` names, None the default, with their drafter.json settings, which
    `kwargs` override) or "untrained" (`num_heads` fresh heads)."""
    from ..drafting.heads import BlockDraftHeads

    if heads == "untrained":
        return BlockDrafter(BlockDraftHeads.for_base_model(model, num_heads=num_heads), profile=True, **kwargs)
    if heads == "packaged":
        from ..io.packaged import load_packaged_drafter

        drafter = load_packaged_drafter(model=packaged_model, **kwargs)
        drafter.profile = True
        return drafter
    return BlockDrafter.from_pretrained(heads, profile=True, **kwargs)


def _tree_size(value: str) -> int | str:
    return value if value == "auto" else int(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-bpd bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("data", nargs="?", default=DEFAULT_DATA, help="Spec-Bench-format jsonl")
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
        "hf_bpd_static (hf_bpd on a static cache), prompt_lookup, "
        "prompt_lookup_fast, assisted (the shipped rescorer LM as a draft "
        "model), hf_bpd (heads alone), hf_bpd+NAME with NAME a shipped rescorer (hf_bpd.packaged_rescorers()), "
        "hf_bpd_typical (with --do-sample: Medusa's typical acceptance, lossy), hf_bpd_greedy (with --do-sample: "
        "the same drafter decoding greedily on the same turns, the greedy τ that sampling's τ is compared with)",
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
        return _report(results, info, args.output)

    if args.rounds < 1 or (args.rounds > 1 and args.batch_size == [1]):
        raise SystemExit(f"--rounds repeats the batches of --batch-size B > 1: it must be >= 1, got {args.rounds}")
    check_data_file(args.data)
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

    from ..io.models import load_model
    from ..io.packaged import resolve_packaged_name

    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    packaged = resolve_packaged_name(args.model)  # the packaged model whose heads and rescorers the run uses
    kwargs = {k: v for k, v in (("top_k", args.top_k), ("max_tree_tokens", args.max_tree_tokens)) if v is not None}
    drafter = load_drafter(args.heads, model, args.num_heads, packaged, **kwargs)
    drafter.packed_linear = {"auto": None, "on": True, "off": False}[args.packed_linear]
    if args.context_lookup is not None:
        drafter.context_lookup = args.context_lookup
    if args.resume and not args.output:
        raise SystemExit("--resume continues the journal of --output: give --output")
    env = environment(args.device, args.dtype)  # before the run writes anything
    journal = Path(args.output).with_suffix(".journal.jsonl") if args.output else None
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
        "drafter": {
            "num_heads": drafter.num_heads,
            "top_k": drafter.top_k,
            "max_tree_tokens": drafter.max_tree_tokens,
            "calibrate": drafter.calibration is not None,
            "packed_linear": args.packed_linear,
            "context_lookup": drafter.context_lookup,
            "heads_sha1": _digest(drafter.heads.state_dict()),
        },
        "rescorer_specs": _rescorer_specs(args.methods, packaged),
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

    def with_rescorer(name: str) -> Method:
        from ..io.packaged import packaged_rescorer

        rescored = drafter.with_rescorer(packaged_rescorer(name, tokenizer, model=packaged))
        return bpd_method(model, rescored, f"hf_bpd+{name}", decoding)

    def assisted() -> Method:
        from ..io.packaged import packaged_rescorer

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
        "hf_bpd_static": lambda: bpd_method(
            model, drafter.with_rescorer(drafter.rescorer), "hf_bpd_static", {**decoding, **STATIC}
        ),
        "hf_bpd_typical": typical,
        "hf_bpd_greedy": greedy_twin,
    }
    unknown = {m for m in args.methods if m not in available and not m.startswith("hf_bpd+")}
    if unknown:
        raise SystemExit(f"unknown methods {sorted(unknown)}; available: {sorted(available)} and hf_bpd+RESCORER")
    methods = [available["greedy"]()] + [
        available[m]() if m in available else with_rescorer(m.split("+", 1)[1]) for m in args.methods if m != "greedy"
    ]
    rows = select_rows(read_jsonl(args.data), args.categories, args.per_category, args.limit, args.spread)
    if batched:
        from .bench_batch import run_batch_bench

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
        return _report(summarize(records, [m.name for m in methods]), info, args.output)
    seed = args.seed if args.do_sample else None
    results = run_bench(
        model, tokenizer, rows, methods, args.max_new_tokens, not args.no_progress, journal, header, seed
    )
    return _report(
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


def _report(results: dict, info: dict, output: str | None, sampled: bool = False) -> int:
    """Print the tables; write JSON (`info` + results), .md and .png beside `output`; 1 if a greedy run
    was not lossless (sampled runs report how many turns match the seeded plain sampling: hf_bpd draws
    as it does, up to rounding, other methods draw differently)."""
    report = {**info, "methods": results}
    table = markdown_table(results)
    print(table)
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(json.dumps(report, indent=2))
        Path(output).with_suffix(".md").write_text(table + "\n")
        try:
            plot(results, Path(output).with_suffix(".png"))
        except ImportError:
            print("matplotlib is not installed: no plot (pip install hf_bpd[analysis])", file=sys.stderr)
    bad = [m for m, r in results.items() if not r["overall"]["identical"]]
    if bad and not sampled:
        print(f"NOT LOSSLESS: {bad} differ from greedy", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
