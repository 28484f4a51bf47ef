"""Context copy (`hf_bpd.drafting.context_copy`): the heads' pointer into the context, its mixture with the heads'
own distribution, decoding with it (lossless, replay equal to decoding) and training it."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import random_heads, tiny_distilled, tiny_model
from test_training import args_for

import hf_bpd
from hf_bpd.drafting.context_copy import CopyTargets, distance_bucket, mixed_logprobs, target_logprob
from hf_bpd.drafting.heads import BlockDraftHeads
from hf_bpd.tools.replay import replay_turn
from hf_bpd.training import train_heads


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", eos_token_id=None)


def copy_heads(model, dim: int = 8, seed: int = 0, std: float = 0.3, draft_vocab_size: int = 0):
    """'previous' heads with random weights and a random pointer."""
    vocab = None if not draft_vocab_size else torch.arange(draft_vocab_size)
    heads = random_heads(model, num_heads=3, seed=seed, std=std, token_input="previous", draft_vocab=vocab)
    heads = heads.with_context_copy(dim)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in heads.context_copy.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return heads.eval()


def test_memory_holds_each_bigram_and_the_token_after_it(model):
    heads = copy_heads(model)
    context = torch.tensor([[5, 6, 7, 8, 9, 0, 0], [5, 6, 7, 8, 9, 10, 11]])
    memory = heads.copy_memory(context, torch.tensor([5, 7]))
    # keys j = 1 .. length-2; value x[j+1]; the root (last token) is a value, never a key's second token
    assert memory.values.tolist()[1] == [7, 8, 9, 10, 11]
    assert memory.valid.tolist() == [[True, True, True, False, False], [True] * 5]
    assert memory.distance[1].tolist() == distance_bucket(torch.tensor([5, 4, 3, 2, 1])).tolist() == [2, 2, 1, 1, 0]
    # a key is its bigram: equal bigrams have equal keys, whatever surrounds them
    again = heads.copy_memory(torch.tensor([[50, 60, 6, 7, 1, 2]]))
    assert torch.allclose(again.keys[0, 2], memory.keys[1, 1])  # bigram (6, 7) in both


@pytest.mark.parametrize("draft_vocab_size", [0, 40])
def test_mixture_is_a_distribution_and_training_scores_what_drafting_ranks(model, draft_vocab_size):
    heads = copy_heads(model, draft_vocab_size=draft_vocab_size)
    context = torch.randint(3, 97, (1, 25), generator=torch.Generator().manual_seed(3))
    memory = heads.copy_memory(context)
    states = heads.step(1, torch.randn(4, model.config.hidden_size), torch.tensor([3, 4, 5, 6]))
    i, before = torch.full((4,), 1), torch.tensor([7, 8, 9, 10])
    with torch.no_grad():
        sink, keys = heads.copy_weights(i, states, before, memory)
        head = heads.project(states).float().log_softmax(-1)
        ids = heads.draft_vocab if draft_vocab_size else None
        mixed = mixed_logprobs(head, ids, model.config.vocab_size, sink, keys, memory.values)
    assert torch.allclose(mixed.exp().sum(-1), torch.ones(4), atol=1e-5)
    # `target_logprob` (training) agrees with the mixture drafting ranks, for tokens in and out of the
    # heads' vocabulary and tokens only the context has
    for target in [int(context[0, 10]), 2, 90]:
        t = torch.full((4,), target)
        index = t if not draft_vocab_size else torch.where(t < draft_vocab_size, t, -1)
        got = target_logprob(head, index, sink, keys, memory.values, t)
        assert torch.allclose(got, mixed[:, target], atol=1e-4), target
    # top_tokens returns the mixture's best tokens as token ids
    top_ids, top_lp = heads.top_tokens(states, 5, i, before, memory)
    assert torch.allclose(top_lp, mixed.topk(5).values, atol=1e-5)
    assert torch.equal(top_ids, mixed.topk(5).indices)


def test_a_pointer_that_matches_the_bigram_copies_what_followed_it_even_outside_the_draft_vocabulary(model):
    heads = copy_heads(model, dim=model.config.hidden_size * 2, draft_vocab_size=40, std=0.0)
    hidden = model.config.hidden_size
    e = model.get_input_embeddings().weight
    scale = 40 * (2 * hidden) ** 0.5 / float(e[30].detach() @ e[30].detach())  # a score of 40 for an exact match
    with torch.no_grad():  # key = [e(x[j-1]); e(x[j])]; query reads [state; e(before)]
        heads.context_copy.key.weight.copy_(torch.eye(2 * hidden))
        for i in range(3):
            q = heads.context_copy.query[i].weight
            q.zero_()
            q[:hidden, hidden:] = scale * torch.eye(hidden)  # e(token before the head's input) -> e(x[j-1])
            heads.context_copy.sink[i].bias.fill_(-20.0)
    # "30 31" was followed by 95 (outside the 40-token draft vocabulary); 30 alone also by 31
    context = torch.tensor([[9, 30, 31, 95, 12, 13, 14, 30]])
    memory = heads.copy_memory(context)
    with torch.no_grad():  # the head read 31 after 30: the query sees 30 (the state part has zero weights)
        ids, lps = heads.top_tokens(torch.zeros(1, hidden), 3, torch.tensor([0]), torch.tensor([30]), memory)
    assert int(ids[0, 0]) == 95 and 95 >= 40 and math.exp(float(lps[0, 0])) > 0.5


def test_context_copy_heads_decode_losslessly_and_replay_equals_decoding(model):
    heads = copy_heads(model, std=0.2)
    prompt = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]])
    ref = model.generate(prompt, do_sample=False, max_new_tokens=30)
    drafter = hf_bpd.BlockDrafter(heads, top_k=3, max_tree_tokens=12)
    out = model.generate(prompt, do_sample=False, max_new_tokens=30, custom_generate=hf_bpd.generate, assistant=drafter)
    assert out.tolist() == ref.tolist()
    replayed = replay_turn(model, hf_bpd.BlockDrafter(heads, top_k=3, max_tree_tokens=12), prompt, ref[0, 12:].tolist())
    assert replayed.accepted_lengths == drafter.stats.accepted_lengths
    assert replayed.tree_sizes == drafter.stats.tree_sizes


def test_context_copy_heads_save_reload_bit_identical_and_first_heads_keep_their_pointers(model, tmp_path):
    heads = copy_heads(model)
    heads.save_pretrained(tmp_path)
    again = BlockDraftHeads.from_pretrained(tmp_path).bind(model)
    assert again.config.copy_dim == 8
    for (name, a), (_, b) in zip(sorted(heads.state_dict().items()), sorted(again.state_dict().items())):
        assert torch.equal(a, b), name
    two = again.first_heads(2)
    assert len(two.context_copy.query) == 2 and two.context_copy.distance_bias.shape[0] == 2
    assert torch.equal(two.context_copy.query[1].weight, heads.context_copy.query[1].weight)
    assert torch.equal(two.context_copy.key.weight, heads.context_copy.key.weight)


def test_chain_lattice_of_context_copy_heads_follows_the_mixture(model):
    from hf_bpd.drafting.expansion import chain_lattice

    heads = copy_heads(model, std=0.2)
    hidden = torch.randn(2, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    context = torch.randint(3, 97, (2, 20), generator=torch.Generator().manual_seed(2))
    lattice = chain_lattice(heads, hidden, context[:, -1], 4, context)
    with torch.no_grad():  # position 1: head 1 reading the root, the token before it is context[:, -2]
        state = heads.step(0, hidden, context[:, -1])
        ids, lps = heads.top_tokens(
            state, 4, torch.zeros(2, dtype=torch.long), context[:, -2], heads.copy_memory(context)
        )
    assert torch.equal(lattice.tokens[:, 0], ids) and torch.allclose(lattice.logprobs[:, 0], lps)
    plain = chain_lattice(heads.without_context_copy(), hidden, context[:, -1], 4)
    assert not torch.equal(plain.logprobs, lattice.logprobs)  # the pointer changes the drafts


def test_without_context_copy_keeps_the_heads_own_weights(model):
    heads = copy_heads(model)
    plain = heads.without_context_copy()
    assert plain.context_copy is None and plain.config.copy_dim == 0
    x, tokens = torch.randn(3, model.config.hidden_size), torch.randint(0, 97, (3, 3))
    with torch.no_grad():
        torch.testing.assert_close(plain(x, tokens), heads(x, tokens))


def test_context_copy_refusals(model):
    with pytest.raises(ValueError, match="token_input='previous'"):
        random_heads(model, token_input="next").with_context_copy(8)
    with pytest.raises(ValueError, match="already have a context-copy pointer"):
        copy_heads(model).with_context_copy(8)
    with pytest.raises(ValueError, match="copy_dim must be >= 1"):
        from hf_bpd.drafting.context_copy import ContextCopy

        ContextCopy(8, 2, 0)


def test_training_only_the_pointer_keeps_the_heads_and_learns_to_copy(model, tmp_path):
    # answers that repeat their prompt: a pointer can predict them, the tiny heads hardly
    data = tiny_distilled(model, n=24, prompt_len=12, new=16)
    base = train_heads.train_frozen(
        model, data, args_for(tmp_path / "heads", num_heads=3, epochs=3, lr=3e-2, batch_size=64, val_fraction=0.2)
    )[0]
    base.save_pretrained(tmp_path / "heads_saved")
    args = args_for(
        tmp_path / "copy",
        init=tmp_path / "heads_saved",
        copy_dim=16,
        freeze_heads=True,
        epochs=15,
        lr=3e-2,
        batch_size=64,
        val_fraction=0.2,
        top_k=3,
    )
    heads, history = train_heads.train_frozen(model, data, args)
    assert heads.config.copy_dim == 16
    for name, value in base.state_dict().items():  # the heads' own weights are untouched
        assert torch.equal(heads.state_dict()[name], value), name
    losses = [r["train_loss"] for r in history]
    assert losses[-1] < 0.9 * losses[0]
    first, last = sum(history[0]["top1"]), sum(history[-1]["top1"])
    assert last > 1.5 * first  # held-out accuracy of the mixture rises with it
    # the drafter with the trained pointer stays lossless
    drafter = hf_bpd.BlockDrafter(heads, top_k=3, max_tree_tokens=8)
    ids = torch.tensor([data[0]["prompt_ids"]])
    ref = model.generate(ids, do_sample=False, max_new_tokens=16)
    out = model.generate(ids, do_sample=False, max_new_tokens=16, custom_generate=hf_bpd.generate, assistant=drafter)
    assert out.tolist() == ref.tolist()
    with pytest.raises(ValueError, match="--freeze-heads trains only a context-copy pointer"):
        train_heads.train_frozen(model, data, args_for(tmp_path / "x", freeze_heads=True, epochs=1))
    with pytest.raises(ValueError, match="--copy-dim 4 differs"):
        heads.save_pretrained(tmp_path / "copy_saved")
        train_heads.train_frozen(model, data, args_for(tmp_path / "y", init=tmp_path / "copy_saved", copy_dim=4))


def test_copy_targets_are_what_decoding_would_see():
    from hf_bpd.training.copy_training import SampleTokens, copy_targets, feature_positions

    rows = [{"prompt_ids": [1, 2, 3], "response_ids": [4, 5, 6, 7]}, {"prompt_ids": [8, 9], "response_ids": [10, 11]}]
    tokens = SampleTokens.build(rows, lambda n: n - 1)
    sample = torch.tensor([0, 0, 0, 0, 1, 1])  # features rows: positions 2..5 of sample 0, 1..2 of sample 1
    positions = feature_positions(sample, tokens)
    assert positions.tolist() == [2, 3, 4, 5, 1, 2]
    targets = torch.tensor([[5, 6], [6, 7], [7, -100], [-100, -100], [11, -100], [-100, -100]])
    read, t = copy_targets(tokens, sample[:2], positions[:2], targets[:2], None)
    # position 2 (token 3): the root is x[3] = 4; head 0 reads 4 (target 5), head 1 reads 5 (target 6)
    assert read.tolist() == [[4, 5], [5, 6]] and t.before.tolist() == [[3, 4], [4, 5]]
    assert t.context.tolist() == [[1, 2, 3, 4, 0], [1, 2, 3, 4, 5]] and t.lengths.tolist() == [4, 5]
    assert isinstance(t, CopyTargets)


def test_evaluate_heads_scores_saved_heads_and_a_pointer_that_never_copies_changes_nothing(model, tmp_path):
    import json

    from hf_bpd.training import evaluate_heads

    model.save_pretrained(tmp_path / "model")
    tiny_distilled(model, n=6, prompt_len=8, new=12).save_to_disk(str(tmp_path / "data"))
    plain = random_heads(model, num_heads=3, token_input="previous", std=0.2)
    plain.save_pretrained(tmp_path / "plain")
    never = plain.with_context_copy(8)
    with torch.no_grad():
        for sink in never.context_copy.sink:
            sink.bias.fill_(100.0)  # all weight on the head's own distribution
    never.save_pretrained(tmp_path / "never")
    out = tmp_path / "eval.json"
    argv = ["--model", str(tmp_path / "model"), "--data", str(tmp_path / "data"), "--heads", str(tmp_path / "plain")]
    argv += [str(tmp_path / "never"), "--features-cache", str(tmp_path / "features"), "--top-k", "3"]
    assert evaluate_heads.main([*argv, "--output", str(out)]) == 0
    results = json.loads(out.read_text())["heads"]
    a, b = results[str(tmp_path / "plain")], results[str(tmp_path / "never")]
    assert a["positions"] == b["positions"] > 0 and len(a["top1"]) == 3
    assert a["top1"] == pytest.approx(b["top1"]) and a["oracle_top3"] == pytest.approx(b["oracle_top3"])


def test_bigram_lookup_predicts_what_followed_the_most_recent_match_inside_the_context():
    from research.copy_oracle import bigram_lookup

    seq = [1, 7, 8, 9, 4, 7, 8, 5, 6, 7, 8, 3]
    # target index 11 (3) follows (7, 8); matches end at 2 and 6; the context x[0..9] sees both: the most
    # recent, at 6, was followed by 5
    assert bigram_lookup(seq, 11, 9) == 5
    assert bigram_lookup(seq, 11, 5) == 9  # a context ending at 5 holds only the first match
    assert bigram_lookup([2, 8, 4, 0, 8, 6], 5, 3) == 4  # no bigram (0, 8) before: the last 8 alone
    assert bigram_lookup([1, 2, 3, 4, 5], 4, 3) is None
