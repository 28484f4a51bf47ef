"""`hf-bpd analyze`'s statistics on hand-made cases and on a tiny model."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import random_heads, tiny_model

from hf_bpd import BlockDrafter
from hf_bpd.drafting.rescoring.ngram import NgramRescorer
from hf_bpd.tools.analyze import analyze_row, h_max, pearson, prefix_match, repeats, simulated_tau, summarise
from hf_bpd.tools.analyze import main as analyze_main


def test_simulated_tau_counts_steps_like_decoding():
    assert simulated_tau([0, 0, 0, 0]) == pytest.approx(4 / 5)  # plain decoding: one token per forward
    # accept 3 at t=0 (4 tokens), then t=4: accept 1 (2 tokens) -> 6 tokens in 2 steps + prefill
    assert simulated_tau([3, 9, 9, 9, 1, 9]) == pytest.approx(6 / 3)


def test_small_statistics():
    assert prefix_match([1, 2, 3], [1, 2, 4]) == 2 and prefix_match([5], [1]) == 0
    assert repeats([7, 7, 7, 2]) == (2, 3, 3) and repeats([1, 2, 3]) == (0, 2, 1)
    assert h_max([1.0, 2.0, 3.0, 2.5]) == 3 and h_max([2.0, 1.0]) == 1
    assert pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0) and math.isnan(pearson([1, 2], [1, 2]))


@pytest.mark.parametrize("token_input", ["", "next", "previous"])
def test_analyze_row_and_summary_on_a_tiny_model(token_input):
    model = tiny_model("llama", eos_token_id=None)
    drafter = BlockDrafter(random_heads(model, 3, token_input=token_input), top_k=4)
    drafter.heads.bind(model)
    prompt = [1, 10, 11, 12]
    answer = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20)[0, 4:].tolist()
    row = analyze_row(model, drafter, NgramRescorer(None, context_weight=0.5), prompt, answer)
    n = len(answer) - 3  # positions with a full h-token continuation
    assert len(row["vanilla"]) == len(row["rescored"]) == len(row["oracle_k1"]) == n
    # the oracle with k = 1 is the heads' top-1 draft; wider lattices contain at least as much
    assert row["oracle_k1"] == row["vanilla"]
    assert all(a <= b for a, b in zip(row["oracle_k4"], row["oracle_k16"]))
    summary = summarise({"cat": [row]}, 3)["categories"]["cat"]
    assert summary["wins"] + summary["ties"] + summary["losses"] == n
    assert 0 <= summary["repeat_pct_vanilla"] <= 100 and len(summary["mean_entropy"]) == 3


def test_an_unshipped_rescorer_is_refused_before_the_model_loads(monkeypatch, tmp_path):
    # Gemma ships only the context rescorer: asking for SmolLM2's "best" must fail at once, naming what is shipped
    import hf_bpd.io.models

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the rescorer name was checked")

    monkeypatch.setattr(hf_bpd.io.models, "load_model", no_loading)
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"question_id": 1, "category": "qa", "turns": ["Why?"]}\n')
    refusal = r"no rescorer named 'best' is shipped for gemma-3-270m: shipped \['context'\]"
    with pytest.raises(SystemExit, match=refusal):
        analyze_main([str(data), "--model", "gemma-3-270m", "--rescorer", "best", "--output", str(tmp_path / "out")])
