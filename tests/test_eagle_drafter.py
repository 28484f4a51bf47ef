"""research/eagle_drafter.py: the drafter's decoder layer starts as the base model's last one (the same outputs at
depth 1 on the same input), a row reads no later position of the context nor any other row's chain, padding of a
shorter sequence changes nothing, and accepted drafts count leading hits."""

import torch

from research.eagle_drafter import EagleDrafter, accepted, answer_features, padded_batch
from tests.conftest import tiny_model


def drafter_for(model) -> EagleDrafter:
    return EagleDrafter(model, torch.arange(model.config.vocab_size)).eval()


def item(length: int, hidden: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(vocab, (length,), generator=g), torch.randn(length, hidden, generator=g).half(), 2


def test_depth_one_is_the_base_models_last_layer_on_its_input():
    model = tiny_model()
    drafter = drafter_for(model)
    features, tokens, _ = padded_batch([item(9, model.config.hidden_size, model.config.vocab_size, 0)])
    ours = drafter.unroll(features, tokens, 1)[0]
    x = drafter.layer_input(features[:, :-1], tokens[:, 1:])
    positions = torch.arange(8)[None]
    mask = torch.full((8, 8), float("-inf")).triu(1)[None, None]
    layer = model.model.layers[-1]
    theirs = model.model.norm(
        layer(x, attention_mask=mask, position_ids=positions, position_embeddings=model.model.rotary_emb(x, positions))
    )
    theirs = theirs[0] if isinstance(theirs, tuple) else theirs
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_a_row_reads_no_later_position_and_padding_changes_nothing():
    model = tiny_model()
    drafter = drafter_for(model)
    with torch.no_grad():
        drafter.fc.weight.normal_(std=0.1)  # trained: the token matters too
    hidden, vocab, depth = model.config.hidden_size, model.config.vocab_size, 3
    long, short = item(12, hidden, vocab, 1), item(7, hidden, vocab, 2)
    together = drafter.unroll(*padded_batch([long, short])[:2], depth)
    alone = drafter.unroll(*padded_batch([short])[:2], depth)
    for j in range(depth):
        torch.testing.assert_close(together[j][1, :6], alone[j][0], rtol=1e-5, atol=1e-5)
    t = 4  # row t at depth j reads features ≤ t and tokens ≤ t + j: change everything after them
    tokens, features, start = long
    tokens2, features2 = tokens.clone(), features.clone()
    features2[t + 1 :] += 1.0
    tokens2[t + depth + 1 :] = (tokens2[t + depth + 1 :] + 1) % vocab
    moved = drafter.unroll(*padded_batch([(tokens2, features2, start)])[:2], depth)
    before = drafter.unroll(*padded_batch([long])[:2], depth)
    for j in range(depth):
        torch.testing.assert_close(moved[j][0, : t + 1], before[j][0, : t + 1], rtol=1e-5, atol=1e-5)
        assert not torch.allclose(moved[j][0, t + 1 :], before[j][0, t + 1 :])


def test_accepted_counts_leading_hits():
    hits = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    assert accepted(hits).tolist() == [2, 0, 4]


def test_answer_features_hold_the_heads_rows_and_targets():
    tokens = torch.arange(10, 20)
    feats = answer_features([(tokens, torch.randn(10, 8).half(), 4)])
    # positions t = 3 .. 8: from the last prompt token to the last with a next token
    assert feats.hidden.shape == (6, 8) and feats.next_token.tolist() == list(range(14, 20))
    assert feats.targets[0].tolist() == [15, 16, 17, 18, 19]  # tokens t+2 .. t+6 of t = 3
    assert feats.targets[-2, 0] == 19 and (feats.targets[-2, 1:] < 0).all()  # past the end: no target
    assert (feats.targets[-1] < 0).all()
