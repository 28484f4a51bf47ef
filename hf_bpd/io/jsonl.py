"""JSON-lines reading and writing. Reading splits on "\\n" only: `str.splitlines` also splits on U+2028/U+2029,
which are legal inside JSON strings (and occur in Spec-Bench and T0 prompts)."""

from __future__ import annotations

import json
from pathlib import Path


def parse_jsonl(text: str) -> list[dict]:
    return [json.loads(line) for line in text.split("\n") if line.strip()]


def read_jsonl(path: str | Path) -> list[dict]:
    return parse_jsonl(Path(path).read_text(encoding="utf-8"))


def write_jsonl(path: str | Path, rows: list[dict]) -> None:
    """`rows` as UTF-8 JSON lines (non-ASCII text kept as is), the folder made if needed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
