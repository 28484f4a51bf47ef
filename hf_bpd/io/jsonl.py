"""JSON-lines reading. Splits on "\\n" only: `str.splitlines` also splits on U+2028/U+2029, which are
legal inside JSON strings (and occur in Spec-Bench and T0 prompts)."""

from __future__ import annotations

import json
from pathlib import Path


def parse_jsonl(text: str) -> list[dict]:
    return [json.loads(line) for line in text.split("\n") if line.strip()]


def read_jsonl(path: str | Path) -> list[dict]:
    return parse_jsonl(Path(path).read_text(encoding="utf-8"))
