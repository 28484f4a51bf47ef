"""research/eagle_drafter.py's measures: accepted drafts count leading hits, and the heads' rows and targets of the
answers (the layer itself: tests/test_eagle_layer.py)."""

import torch

from research.eagle_drafter import accepted, answer_features


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
