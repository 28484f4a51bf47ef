"""`hf-bpd replay`: τ from greedy's answer alone must equal what the decoding loop does, step by step."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import random_heads, tiny_model

import hf_bpd
from hf_bpd import BlockDrafter
from hf_bpd.drafting.tree import DraftTree
from hf_bpd.tools.replay import accept_along, first_turns, greedy_answers, main, replay_turn


def decode(model, drafter, ids, n):
    out = model.generate(ids, do_sample=False, max_new_tokens=n, custom_generate=hf_bpd.generate, assistant=drafter)
    return out, drafter.stats


@pytest.mark.parametrize(
    "token_input, feature_layers, chain",
    [
        ("previous", None, ""),
        ("next", None, ""),
        ("previous", [1, -1], ""),
        ("previous", None, "state"),
        ("previous", None, "beside"),
    ],
)
def test_replay_matches_the_decoding_loop_step_by_step(token_input, feature_layers, chain):
    model = tiny_model("llama", eos_token_id=None)
    # zero residuals: heads that repeat the base model's guess, so multi-token steps happen
    heads = hf_bpd.BlockDraftHeads.for_base_model(model, num_heads=4, token_input=token_input)
    if chain:  # small residuals, so that each head's state differs with the chain it read
        heads = random_heads(model, num_heads=4, token_input=token_input, std=0.01, chain=chain)
    if feature_layers:  # a fusion that also reads layer 1: replay fuses the layers as decoding does
        heads = heads.with_feature_layers(feature_layers)
        with torch.no_grad():
            heads.fusion.linear.weight[:, :32].normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(0)
    multi = False
    for trial in range(4):
        ids = torch.randint(3, 97, (1, int(torch.randint(2, 12, (1,), generator=g))), generator=g)
        out, stats = decode(model, BlockDrafter(heads, top_k=3, max_tree_tokens=12), ids, 40)
        answer = out[0, ids.shape[1] :].tolist()
        result = replay_turn(model, BlockDrafter(heads, top_k=3, max_tree_tokens=12), ids, answer)
        assert result.accepted_lengths == stats.accepted_lengths, trial
        assert result.tree_sizes == stats.tree_sizes
        assert (result.tokens, result.forwards) == (stats.new_tokens, stats.forwards)
        assert result.tau == pytest.approx(stats.block_efficiency)
        multi |= max(result.accepted_lengths) > 1
    assert multi  # the comparison covered accepted drafts, not only bonus tokens


def test_replay_keeps_calibration_learning_like_decoding():
    """One drafter over several turns: what the calibration learned orders later trees identically."""
    model = tiny_model("qwen2", eos_token_id=None)
    heads = random_heads(model, num_heads=3, token_input="previous", std=0.05)
    decoding, replaying = BlockDrafter(heads, 3, 10), BlockDrafter(heads, 3, 10)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(3, 97, (1, 6), generator=g)
        out, stats = decode(model, decoding, ids, 30)
        result = replay_turn(model, replaying, ids, out[0, 6:].tolist())
        assert result.accepted_lengths == stats.accepted_lengths
    learned = decoding.calibration.summary()
    assert learned and replaying.calibration.summary() == pytest.approx(learned, rel=1e-5)  # float noise only


def test_accept_along_stops_at_the_answer_end_and_at_a_missing_child():
    tree = DraftTree.from_paths(5, [(6, 7, 8), (9,)], max_nodes=10)  # root 5; nodes 6->7->8 and 9
    answer = [5, 6, 7, 1, 2]
    assert accept_along(tree, answer, 1) == ([0, 1, 2], False)  # 6, 7 accepted; 1 is not a child of 7
    assert accept_along(tree, [5, 6, 7], 1) == ([0, 1], True)  # the answer ends at 7: 8 never compared
    assert accept_along(tree, [5, 9], 1) == ([0], True)


def test_greedy_answers_are_cached_resumed_and_refused_for_other_settings(tmp_path):
    class Tok:
        def apply_chat_template(self, messages, add_generation_prompt, return_tensors, return_dict):
            ids = [3 + (ord(c) % 90) for m in messages for c in m["content"]][-20:]
            return {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}

        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(65 + i % 26) for i in ids)

    model = tiny_model("llama", eos_token_id=None)
    rows = [{"question_id": 1, "turns": ["ab", "cd"], "category": "x"}, {"question_id": 2, "turns": ["ef"]}]
    header = {"max_new_tokens": 5}
    path = tmp_path / "answers.jsonl"
    first = greedy_answers(model, Tok(), rows[:1], path, header, progress=False)
    assert sorted(first) == [(1, 0), (1, 1)] and all(len(a) == 5 for a in first.values())
    calls = []
    real = model.generate
    model.generate = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    both = greedy_answers(model, Tok(), rows, path, header, progress=False)
    assert len(calls) == 1 and both[(1, 0)] == first[(1, 0)]  # only the new turn was generated
    ids = torch.tensor([[3 + (ord(c) % 90) for c in "ef"]])
    assert both[(2, 0)] == real(ids, do_sample=False, max_new_tokens=5)[0, 2:].tolist()
    assert len(path.read_text().splitlines()) == 1 + 3 and json.loads(path.read_text().splitlines()[0])
    with pytest.raises(ValueError, match="other settings"):
        greedy_answers(model, Tok(), rows, path, {"max_new_tokens": 6}, progress=False)


def test_limit_table_is_tau_times_the_cost_ratio():
    from hf_bpd.decode.cost import ForwardCost
    from hf_bpd.tools.replay import limit_markdown, limit_table

    model = tiny_model("llama")
    heads = random_heads(model)
    drafters = {"k3 n1": BlockDrafter(heads, 3, 1), "k3 n8": BlockDrafter(heads, 3, 8)}
    results = {"k3 n1": {"overall": {"tau": 1.0}}, "k3 n8": {"overall": {"tau": 2.4}}}
    curve = ForwardCost((1, 8), (0.05, 0.08))
    limits = limit_table(results, drafters, curve)
    assert [r["tree_tokens"] for r in limits] == [1, 8]
    assert limits[0]["limit"] == pytest.approx(1.0)
    assert limits[1]["cost_ratio"] == pytest.approx(1.6) and limits[1]["limit"] == pytest.approx(1.5)
    assert "1.50x" in limit_markdown(limits)


def test_max_turns_keeps_each_row_s_first_turns_and_zero_is_refused_before_the_model_loads(monkeypatch):
    rows = [{"question_id": 1, "turns": ["a", "b"]}, {"question_id": 2, "turns": ["c"]}]
    assert [r["turns"] for r in first_turns(rows, 1)] == [["a"], ["c"]]
    assert first_turns(rows, None) is rows and rows[0]["turns"] == ["a", "b"]  # the rows are not changed
    monkeypatch.setattr("hf_bpd.io.models.load_model", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(SystemExit, match="--max-turns must be at least 1"):
        main(["--answers", "unused.jsonl", "--max-turns", "0"])


def test_context_vocab_is_refused_for_heads_it_cannot_serve_before_the_model_loads(monkeypatch, tmp_path):
    heads = tmp_path / "heads"
    random_heads(tiny_model()).save_pretrained(heads)
    monkeypatch.setattr("hf_bpd.io.models.load_model", lambda *a, **k: pytest.fail("the model loaded"))
    for folders, why in (["packaged"], "context copy"), ([str(heads)], "token_input=''"):
        with pytest.raises(SystemExit, match=f"--context-vocab 1: .*{why}"):
            main(["--answers", "unused.jsonl", "--heads", *folders, "--context-vocab", "0", "1"])
