"""The prompts a bench run decodes: Spec-Bench-format rows (`question_id`, `category`, `turns`), or rows of
one `prompt` each (the bundled demo prompts' format; each becomes a one-turn row). The default is the demo
prompts shipped inside the package, which every install has; for Spec-Bench, pass its jsonl."""

from __future__ import annotations

from collections import defaultdict
from importlib import resources
from pathlib import Path

from ...io.jsonl import read_jsonl

BUNDLED_PROMPTS = "data/demo_prompts.jsonl"  # inside the hf_bpd package (`hf-bpd demo`'s prompts)
PROMPT_CATEGORY = "prompts"  # the category of rows that name none (one `prompt` each)


def bundled_prompts() -> Path:
    """The demo prompts shipped inside the installed package, as a file on disk."""
    return Path(str(resources.files("hf_bpd").joinpath(BUNDLED_PROMPTS)))


DEFAULT_DATA = str(bundled_prompts())


def read_prompts(path: str | Path) -> list[dict]:
    """The rows of a prompts jsonl in Spec-Bench's format: rows that have `turns` are kept as they are; a
    row of one `prompt` (the bundled demo prompts) becomes a one-turn row, its `category` "prompts" unless
    it names one and its `question_id` its row number (from 1) unless it has one."""
    rows = []
    for i, row in enumerate(read_jsonl(path), 1):
        if "turns" not in row:
            if "prompt" not in row:
                raise ValueError(f"{path}, row {i}: neither 'turns' (Spec-Bench's format) nor 'prompt'")
            row = {"question_id": i, "category": PROMPT_CATEGORY, **row, "turns": [row["prompt"]]}
        rows.append(row)
    return rows


def check_data_file(path: str) -> None:
    """Refuse a missing prompts file before the model loads."""
    if not Path(path).is_file():
        raise SystemExit(
            f"{path}: no such file. Pass a prompts jsonl as the first argument: Spec-Bench's format (question_id, "
            f"category, turns) or one 'prompt' per row; the default is the bundled demo prompts ({DEFAULT_DATA})"
        )


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
