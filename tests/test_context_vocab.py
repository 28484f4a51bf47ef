"""`context_vocab` for heads (`drafting/context_vocab.py`): "previous" heads tied to the base model's LM head
may draft the context's tokens outside their draft vocabulary, in one softmax with it; decoding with it gives
plain greedy's and seeded sampling's tokens, replay matches the loop, a call starts with an empty context
vocabulary, and heads it cannot serve are refused. (The EAGLE layer's: tests/test_eagle_layer.py; the
captured step's refusal: tests/test_captured_step.py.)"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_replay_matches_loop, random_heads, tiny_model

import hf_bpd
from hf_bpd import BlockDrafter
from hf_bpd.decode.binding import prepare
from hf_bpd.drafting.context_vocab import ContextVocab

DRAFT_VOCAB = torch.arange(0, 97, 3)  # a third of the tiny model's tokens


def narrow_heads(model, seed: int = 0, **kw):
    return random_heads(model, seed=seed, std=0.1, token_input="previous", draft_vocab=DRAFT_VOCAB, **kw)


def greedy(model, ids, n, **kw):
    return model.generate(ids, do_sample=False, max_new_tokens=n, **kw)


def test_heads_score_the_context_s_tokens_outside_their_draft_vocabulary_in_one_softmax():
    model = tiny_model()
    heads = narrow_heads(model).bind(model).eval()
    vocab = ContextVocab()
    context = [4, 5, 6, 9, 5, 40, 41]  # 4, 5, 40, 41 outside the draft vocabulary (5 twice)
    vocab.add(heads, context)
    outside = [4, 5, 40, 41]
    assert vocab.tokens == set(outside)
    assert vocab.extension.ids.tolist() == DRAFT_VOCAB.tolist() + outside
    states = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = states @ model.get_output_embeddings().weight.T
        allowed = torch.full_like(full, float("-inf"))
        allowed[:, DRAFT_VOCAB] = full[:, DRAFT_VOCAB]
        allowed[:, outside] = full[:, outside]
        expected_lp, expected_ids = allowed.log_softmax(-1).topk(6)
        ids, logprobs = heads.top_tokens(states, 6, extension=vocab.extension)
        plain_ids, _ = heads.top_tokens(states, 6)
    assert ids.tolist() == expected_ids.tolist()
    torch.testing.assert_close(logprobs, expected_lp, rtol=1e-5, atol=1e-5)
    assert all(t % 3 == 0 for t in plain_ids.flatten().tolist())
    vocab.add(heads, [40, 42, 43])  # only 43 is new
    assert vocab.extension.ids.tolist()[-5:] == [4, 5, 40, 41, 43]


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_decoding_with_heads_context_vocab_gives_plain_generate_s_tokens(mode):
    model = tiny_model(eos_token_id=None)
    g = torch.Generator().manual_seed(5)
    reached = False
    for trial in range(3):
        drafter = BlockDrafter(narrow_heads(model, seed=trial), top_k=3, max_tree_tokens=10, context_vocab=True)
        ids = torch.randint(3, 97, (1, int(torch.randint(4, 12, (1,), generator=g))), generator=g)
        if mode == "greedy":
            ours = greedy(model, ids, 30, custom_generate=hf_bpd.generate, assistant=drafter)
            assert torch.equal(ours, greedy(model, ids, 30)), trial
        else:
            kw = dict(do_sample=True, temperature=0.8, top_k=30, max_new_tokens=25)
            torch.manual_seed(trial)
            ours = model.generate(ids, custom_generate=hf_bpd.generate, assistant=drafter, **kw)
            torch.manual_seed(trial)
            assert torch.equal(ours, model.generate(ids, **kw)), trial
        accepted = sum(n - 1 for n in drafter.stats.accepted_lengths)
        reached |= bool(drafter._heads_vocab.tokens) and accepted > 0
    assert reached  # the calls gathered context tokens, and drafts were accepted


def test_replay_matches_the_loop_and_each_call_starts_with_an_empty_context_vocab():
    model = tiny_model(eos_token_id=None)
    heads = narrow_heads(model, seed=2)
    g = torch.Generator().manual_seed(6)
    outside_drafted = 0
    for trial in range(3):
        ids = torch.randint(3, 97, (1, int(torch.randint(4, 14, (1,), generator=g))), generator=g)
        decoding = assert_replay_matches_loop(
            model, lambda: BlockDrafter(heads, top_k=3, max_tree_tokens=12, context_vocab=True), ids, trial=trial
        )
        outside_drafted += len(decoding._heads_vocab.tokens)
        prepare(decoding, model)  # the next call's start
        assert decoding._heads_vocab.extension is None and decoding._heads_vocab_positions == 0
    assert outside_drafted > 0


def test_heads_context_vocab_is_refused_where_it_cannot_serve():
    model = tiny_model()
    for heads, match in [
        (narrow_heads(model, copy_dim=8), "through their context copy"),
        (narrow_heads(model, tie_lm_head=False), "a softmax of their own"),
        (random_heads(model, draft_vocab=DRAFT_VOCAB), "heads that read the drafted token"),
    ]:
        with pytest.raises(ValueError, match=match):
            BlockDrafter(heads, context_vocab=True)
    drafter = BlockDrafter(narrow_heads(model), context_vocab=True)  # the captured step's refusal: its tests
    assert drafter.with_rescorer(None).context_vocab is True
