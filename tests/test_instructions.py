"""Templated chat instructions for self-distillation: reproducible, distinct, balanced, no benchmark text."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
from conftest import SPEC_BENCH

from hf_bpd.io.jsonl import read_jsonl
from hf_bpd.training.instructions import TEMPLATES, generate_instructions, main


def test_same_seed_same_prompts_and_all_distinct():
    a = generate_instructions(500, seed=3)
    assert a == generate_instructions(500, seed=3)
    assert a != generate_instructions(500, seed=4)
    assert len({r["prompt"] for r in a}) == 500 and len({r["id"] for r in a}) == 500


def test_no_template_takes_more_than_its_capped_share():
    rows = generate_instructions(600, seed=0)
    counts = Counter(r["source"] for r in rows)
    assert max(counts.values()) <= math.ceil(2.5 * 600 / len(TEMPLATES))
    assert len(counts) == len(TEMPLATES)  # every template is used


def test_impossible_count_raises():
    with pytest.raises(ValueError, match="fewer than"):
        generate_instructions(20_000, seed=0)


def test_shipped_file_is_what_the_command_writes(tmp_path):
    out = tmp_path / "instructions.jsonl"
    main(["--output", str(out), "--num", "2000", "--seed", "0"])
    shipped = Path(__file__).resolve().parents[1] / "training/data/instructions.jsonl"
    assert out.read_text() == shipped.read_text()


@pytest.mark.skipif(not SPEC_BENCH.is_file(), reason=f"{SPEC_BENCH} not present (CI and dev machines have ../shared)")
def test_no_prompt_is_benchmark_text():
    bench = [t for row in read_jsonl(SPEC_BENCH) for t in row["turns"]]
    ours = [r["prompt"] for r in generate_instructions(2000, seed=0)]
    assert not set(ours) & set(bench)
    # not even as a part of a benchmark turn (long prompts only: short phrases may coincide)
    assert not [p for p in ours if len(p) > 60 and any(p in t for t in bench)]
