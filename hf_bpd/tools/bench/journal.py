"""A bench run's journal: a jsonl file of its header (the run's settings) and each finished row's records,
written row by row, so an interrupted run resumes and runs split over processes merge."""

from __future__ import annotations

import hashlib
import json
from collections import Counter, defaultdict
from pathlib import Path

import torch


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


def check_same_machine(path: str | Path, machine: str, cpu_kernel: str | None = None) -> None:
    """Raises when the journal at `path` was timed on another machine than `machine` (`report.machine`), or
    does not say where, or (`cpu_kernel`: `streamed_linear.version()` of a CPU run) with another build of
    hf_bpd's CPU kernel: a resumed run's rows are summed with the journal's, and both its timings and its
    forward-cost curve are only comparable on the same kind of processor with the same kernels. Cheap: read
    before the model loads."""
    header, _ = load_journal(Path(path))
    if header is None:
        return
    if header.get("machine") != machine:
        where = f"on {header['machine']!r}" if "machine" in header else "on a machine it does not record"
        raise ValueError(
            f"{path} was timed {where}; this is {machine!r}. Resume it on that machine, or start over here with "
            "another --output or --overwrite (journals of one run split over machines combine with --merge)"
        )
    if cpu_kernel is not None and header.get("cpu_kernel") != cpu_kernel:
        which = repr(header["cpu_kernel"]) if "cpu_kernel" in header else "one it does not record"
        raise ValueError(
            f"{path} was timed with another build of hf_bpd's CPU kernel ({which}; this one is {cpu_kernel!r}), "
            "whose forwards cost differently; start over with another --output or --overwrite"
        )


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
    # the parts select different rows, and may run on different machines (each part's environment is kept)
    keys = [k for k in RESUME_KEYS if k not in ("selection", "rows", "machine", "cpu_kernel")]  # per machine
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
    "machine",
    "cpu_kernel",
    "drafter",
    "rescorer_specs",
)


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """A content hash of a state dict (which heads a journal was written with)."""
    h = hashlib.sha1()
    for name, tensor in sorted(state.items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def append_records(path: str | Path, records: list[dict]) -> None:
    with open(path, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
