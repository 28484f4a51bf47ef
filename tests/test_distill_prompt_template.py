"""`hf-bpd distill --prompt-template`: a base model (no chat template) distils from plain or Q/A-framed prompts,
the format is recorded in the manifest, and a resumed run must use the same one."""

from __future__ import annotations

import json

import pytest
from conftest import tiny_model

import hf_bpd.io.models
from hf_bpd.training import distill

BOS = 1


class BaseTokenizer:
    """A base model's tokenizer: no chat template, adds <bos> (like Gemma's); one id per character."""

    pad_token_id = 0
    eos_token_id = 2
    bos_token_id = BOS

    def __call__(self, text, add_special_tokens=True):
        ids = [3 + (ord(c) % 90) for c in text]
        return {"input_ids": ([BOS] if add_special_tokens else []) + ids}

    def apply_chat_template(self, messages, add_generation_prompt=True):
        raise ValueError("this tokenizer has no chat template")


class ChatTokenizer(BaseTokenizer):
    def apply_chat_template(self, messages, add_generation_prompt=True):
        return [3 + (ord(c) % 90) for c in "<user>" + messages[0]["content"] + "<assistant>"]


def ids(text):
    return BaseTokenizer()(text, add_special_tokens=False)["input_ids"]


def test_prompt_templates_encode_and_truncate_keeping_bos():
    tok = BaseTokenizer()
    assert distill.encode_prompt(tok, "hi", "qa") == [BOS] + ids("Question: hi\nAnswer:")
    assert distill.encode_prompt(tok, "hi", "plain") == [BOS] + ids("hi")
    assert distill.encode_prompt(tok, "hi", "Q: {prompt} A:") == [BOS] + ids("Q: hi A:")
    # a long prompt keeps <bos> and the end of the framing ("...\nAnswer:"), dropping the prompt's start
    long = distill.encode_prompt(tok, "x" * 50, "qa", max_prompt_tokens=12)
    assert long == [BOS] + ids("xxx\nAnswer:")
    # the chat path is what it was before templates existed: the chat template's ids, last N kept
    chat = ChatTokenizer()
    expected = chat.apply_chat_template([{"role": "user", "content": "hi"}])
    assert distill.encode_prompt(chat, "hi", "chat", max_prompt_tokens=5) == expected[-5:]
    assert distill.decoding_description("chat") == "greedy, chat template with generation prompt"
    assert "Question: {prompt}" in distill.decoding_description("qa")
    with pytest.raises(ValueError, match="prompt"):
        distill.resolve_prompt_template("Answer the question:")


def test_distill_cli_records_the_template_and_resumes_only_with_the_same_one(tmp_path, monkeypatch):
    model = tiny_model("llama", eos_token_id=None)
    monkeypatch.setattr(hf_bpd.io.models, "load_model", lambda *a, **kw: (model, BaseTokenizer()))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": f"what is {i}?"}) + "\n" for i in range(5)))
    out = tmp_path / "out"
    argv = ["--prompts", str(prompts), "--output", str(out), "--seed", "-1", "--max-new-tokens", "3"]
    argv += ["--batch-size", "2", "--shard-size", "2", "--device", "cpu", "--no-progress"]

    assert distill.main(argv + ["--limit", "3", "--prompt-template", "qa"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["prompt_template"] == "Question: {prompt}\nAnswer:"
    assert "no chat template" in manifest["decoding"]
    data = distill.load_distilled(out)
    by_id = dict(zip(data["id"], data["prompt_ids"]))
    assert by_id["1"] == [BOS] + ids("Question: what is 1?\nAnswer:")
    assert all(len(r) == 3 for r in data["response_ids"])

    # the same recipe resumes (the template given by its text is the same recipe) and adds only new prompts
    shards_before = sorted(p.name for p in (out / "shards").glob("shard-*.parquet"))
    assert distill.main(argv + ["--prompt-template", "Question: {prompt}\nAnswer:"]) == 0
    data = distill.load_distilled(out)
    assert sorted(data["id"]) == ["0", "1", "2", "3", "4"]
    assert set(shards_before) < {p.name for p in (out / "shards").glob("shard-*.parquet")}

    # another format would mix two recipes in one folder
    with pytest.raises(SystemExit, match="prompt_template"):
        distill.main(argv + ["--prompt-template", "plain"])


def test_manifest_from_before_templates_resumes_as_chat(tmp_path, monkeypatch):
    model = tiny_model("llama", eos_token_id=None)
    monkeypatch.setattr(hf_bpd.io.models, "load_model", lambda *a, **kw: (model, ChatTokenizer()))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": f"p{i}"}) + "\n" for i in range(2)))
    out = tmp_path / "out"
    argv = ["--prompts", str(prompts), "--output", str(out), "--max-new-tokens", "2", "--device", "cpu"]
    argv += ["--no-progress"]
    assert distill.main(argv) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["prompt_template"] == "chat"
    del manifest["prompt_template"]  # as written before --prompt-template existed
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert distill.main(argv) == 0
    with pytest.raises(SystemExit, match="prompt_template"):
        distill.main(argv + ["--prompt-template", "qa"])


class NoTemplateTokenizer(BaseTokenizer):
    chat_template = None  # what transformers' tokenizers hold when they have none


def test_a_base_model_s_conversation_is_framed_as_its_heads_were_distilled():
    tok = NoTemplateTokenizer()
    one = hf_bpd.io.models.chat_inputs(tok, [{"role": "user", "content": "What is 2+2?"}])
    assert one["input_ids"][0].tolist() == distill.encode_prompt(tok, "What is 2+2?", "qa")
    assert one["attention_mask"].tolist() == [[1] * one["input_ids"].shape[1]]
    turns = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": " Hello."},
        {"role": "user", "content": "Bye"},
    ]
    two = hf_bpd.io.models.chat_inputs(tok, turns)["input_ids"][0].tolist()
    assert two == [BOS] + ids("Question: Hi\nAnswer: Hello.\nQuestion: Bye\nAnswer:")
    with pytest.raises(ValueError, match="ends with a user message"):
        hf_bpd.io.models.chat_inputs(tok, turns[:2])
