"""hf_bpd.decode.support: every architecture of the support matrix is exact or refused up front; inputs and
options the loop would not honour are refused by name before any forward; the usual streamer works."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from support_matrix import ROWS, build, matrix_block
from transformers import DynamicCache
from transformers.generation.streamers import BaseStreamer

import hf_bpd
from hf_bpd import BlockDrafter, BlockDraftHeads
from hf_bpd.compat import cache_argument
from hf_bpd.tools.forward_counter import ForwardCounter

# prompt length, max_new_tokens: every exact row decodes all three (longest: 60 tokens in all)
CASES = ((1, 20), (7, 40), (30, 25))


def copying_drafter(model, **kw) -> BlockDrafter:
    # zero-residual heads draft the base model's own next token: on a random model's repetitive text they are
    # often right, so multi-token acceptance is exercised
    return BlockDrafter(BlockDraftHeads.for_base_model(model, num_heads=3), top_k=3, max_tree_tokens=8, **kw)


def decode(model, ids, drafter=None, **kw):
    extra = dict(custom_generate=hf_bpd.generate, assistant=drafter) if drafter is not None else {}
    return model.generate(ids, do_sample=False, pad_token_id=0, **kw, **extra)


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_support_matrix(row):
    model = build(row)
    drafter = copying_drafter(model)
    g = torch.Generator().manual_seed(1)
    if row.expected == "refused":
        ids = torch.randint(3, 97, (1, 7), generator=g)
        with ForwardCounter(model) as counter, pytest.raises(ValueError, match=row.refusal):
            decode(model, ids, drafter, max_new_tokens=40)
        assert counter.count == 0, "refused only after a forward"
        return
    sizes = []
    for prompt_len, new in CASES:
        ids = torch.randint(3, 97, (1, prompt_len), generator=g)
        # no eos: a random model may emit it at once, and every length should be decoded
        ref = decode(model, ids, max_new_tokens=new, eos_token_id=None)
        out = decode(model, ids, drafter, max_new_tokens=new, eos_token_id=None)
        assert out.tolist() == ref.tolist(), f"{row.name}: prompt {prompt_len}, {new} new tokens"
        sizes += drafter.stats.tree_sizes
    assert max(sizes) > 1  # trees were verified, not single tokens


def test_the_support_page_shows_the_support_matrix():
    from support_matrix import PAGE

    assert matrix_block() in PAGE.read_text(encoding="utf-8"), "run: python -m tests.support_matrix"


def test_windowed_models_are_not_refused_for_length():
    # a sliding window far shorter than prompt + max_new_tokens: served, token for token
    model = tiny_model("mistral", sliding_window=6, eos_token_id=None)
    drafter = BlockDrafter(BlockDraftHeads.for_base_model(model, num_heads=4), top_k=3, max_tree_tokens=16)
    ids = torch.tensor([[5, 6, 7, 8]])
    assert decode(model, ids, drafter, max_new_tokens=50).tolist() == decode(model, ids, max_new_tokens=50).tolist()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(cache_implementation="offloaded"), "cache_implementation='offloaded'"),
        (dict(return_dict_in_generate=True, output_hidden_states=True), "hidden states"),
        (dict(return_dict_in_generate=True, output_attentions=True), "attentions"),
    ],
)
def test_unsupported_options_are_refused_before_any_forward(kwargs, message):
    model = tiny_model("llama")
    with ForwardCounter(model) as counter, pytest.raises(ValueError, match=message):
        decode(model, torch.tensor([[5, 6, 7]]), copying_drafter(model), max_new_tokens=5, **kwargs)
    assert counter.count == 0


def test_unsupported_inputs_are_refused_before_any_forward():
    model = tiny_model("llama")
    drafter = copying_drafter(model)
    embeds = model.get_input_embeddings()(torch.tensor([[5, 6, 7]]))
    with ForwardCounter(model) as counter, pytest.raises(ValueError, match="inputs_embeds"):
        model.generate(inputs_embeds=embeds, max_new_tokens=5, custom_generate=hf_bpd.generate, assistant=drafter)
    assert counter.count == 0
    filled = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.tensor([[5, 6]]), **{cache_argument(model): filled})
    with ForwardCounter(model) as counter, pytest.raises(ValueError, match="filled"):
        decode(model, torch.tensor([[5, 6, 7]]), drafter, max_new_tokens=5, past_key_values=filled)
    assert counter.count == 0
    gpt2 = build(next(r for r in ROWS if r.model_type == "gpt2"))
    ids = torch.tensor([[5, 6, 7]])
    with ForwardCounter(gpt2) as counter, pytest.raises(ValueError, match="token_type_ids"):
        decode(gpt2, ids, copying_drafter(gpt2), max_new_tokens=5, token_type_ids=torch.zeros_like(ids))
    assert counter.count == 0


def test_empty_prompt_is_refused():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="empty"):
        hf_bpd.decode.support.check_call_supported(
            model, torch.zeros(1, 0, dtype=torch.long), model.generation_config, {"attention_mask": None}
        )


class RecordingStreamer(BaseStreamer):
    def __init__(self):
        self.puts: list[list[int]] = []
        self.ended = 0

    def put(self, value):
        self.puts.append(value.reshape(-1).tolist())

    def end(self):
        self.ended += 1


def test_streamer_given_the_usual_way_gets_prompt_once_every_token_and_end():
    model = tiny_model("llama", eos_token_id=None)
    ids = torch.tensor([[5, 6, 7]])
    plain, ours = RecordingStreamer(), RecordingStreamer()
    ref = decode(model, ids, max_new_tokens=12, streamer=plain)
    out = decode(model, ids, copying_drafter(model), max_new_tokens=12, streamer=ours)
    assert out.tolist() == ref.tolist()
    assert ours.ended == plain.ended == 1
    assert ours.puts[0] == plain.puts[0] == [5, 6, 7]  # the prompt, once
    assert sum(ours.puts[1:], []) == sum(plain.puts[1:], []) == ref[0, 3:].tolist()


def test_heads_run_beside_the_lm_head():
    model = tiny_model("llama")
    drafter = copying_drafter(model)
    hf_bpd.prepare(drafter, model)
    assert drafter.heads.device == model.get_output_embeddings().weight.device


def test_a_drafter_busy_in_another_generation_is_refused_not_mixed():
    model = tiny_model("llama")
    drafter = copying_drafter(model)
    with drafter.exclusive(), pytest.raises(RuntimeError, match="already decoding"):  # as if another thread held it
        decode(model, torch.tensor([[5, 6, 7]]), drafter, max_new_tokens=4)
    ids = torch.tensor([[5, 6, 7]])
    assert decode(model, ids, drafter, max_new_tokens=4).tolist() == decode(model, ids, max_new_tokens=4).tolist()


def test_max_new_tokens_zero_behaves_like_generate():
    model = tiny_model("llama")
    ids = torch.tensor([[5, 6, 7]])
    try:
        ref, error = decode(model, ids, max_new_tokens=0), None
    except Exception as err:  # noqa: BLE001 - whatever plain generate does, hf_bpd must do the same
        ref, error = None, err
    if error is not None:
        with pytest.raises(type(error)):
            decode(model, ids, copying_drafter(model), max_new_tokens=0)
    else:
        assert decode(model, ids, copying_drafter(model), max_new_tokens=0).tolist() == ref.tolist()


def test_nan_logits_decode_as_plain_greedy_does():
    model = tiny_model("llama", eos_token_id=None)
    with torch.no_grad():
        model.model.layers[-1].mlp.down_proj.weight[0, 0] = float("nan")  # NaN hidden states, NaN logits
    ids = torch.tensor([[5, 6, 7]])
    ref = decode(model, ids, max_new_tokens=6)
    assert decode(model, ids, copying_drafter(model), max_new_tokens=6).tolist() == ref.tolist()
