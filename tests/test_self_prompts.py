"""Self-written chat prompts (Magpie): sampled after the chat template's user prefix, deterministic per seed,
whole messages only, refused for tokenizers without a chat template."""

from __future__ import annotations

import json

import pytest

from hf_bpd.training import self_prompts as sp


def test_user_prefix_is_the_chat_template_before_the_user_s_message(smollm2):
    _, tokenizer = smollm2
    prefix = tokenizer.decode(sp.user_prefix(tokenizer))
    whole = tokenizer.apply_chat_template([{"role": "user", "content": "Hello there"}], tokenize=False)
    assert prefix.endswith("<|im_start|>user\n") and whole.startswith(prefix)
    assert whole[len(prefix) :].startswith("Hello there")


def test_self_prompts_are_distinct_whole_messages_and_repeat_with_the_seed(smollm2, tmp_path, monkeypatch):
    model, tokenizer = smollm2
    first = sp.self_prompts(model, tokenizer, num=4, seed=0, batch_size=4, max_new_tokens=64)
    assert len(first) == 4 and len(set(first)) == 4 and all(p and p == p.strip() for p in first)
    assert not any("<|im_end|>" in p or "<|im_start|>" in p for p in first)
    assert sp.self_prompts(model, tokenizer, num=4, seed=0, batch_size=4, max_new_tokens=64) == first
    assert sp.self_prompts(model, tokenizer, num=4, seed=1, batch_size=4, max_new_tokens=64) != first
    monkeypatch.setattr("hf_bpd.io.models.load_model", lambda name: (model, tokenizer))
    out = tmp_path / "prompts.jsonl"
    assert sp.main(["--output", str(out), "--num", "4", "--batch-size", "4", "--max-new-tokens", "64"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == first and rows[0]["id"] == "self-0"


def test_self_prompts_stop_when_the_model_never_ends_a_message(smollm2):
    model, tokenizer = smollm2
    with pytest.raises(RuntimeError, match="finished, distinct messages"):
        sp.self_prompts(model, tokenizer, num=1, batch_size=2, max_new_tokens=1)


def test_a_tokenizer_without_a_chat_template_is_refused(smollm2):
    class BaseTokenizer:
        chat_template = None

    with pytest.raises(ValueError, match="chat template"):
        sp.user_prefix(BaseTokenizer())
