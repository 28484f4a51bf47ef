"""research/prefix_attention.py: the prefix layer starts as the identity, reads only earlier positions, and
ignores the padding of shorter answers in a batch; features are split and padded by sample."""

from dataclasses import replace

import torch

from hf_bpd.training.train_heads import Features
from research.prefix_attention import PrefixAttention, padded, sample_spans, transformed


def features(lengths: list[int], hidden: int = 128) -> Features:
    n = sum(lengths)
    sample = torch.cat([torch.full((length,), i) for i, length in enumerate(lengths)])
    zeros = torch.zeros(n, dtype=torch.long)
    return Features(torch.randn(n, hidden), zeros[:, None], zeros, sample, zeros.bool())


def test_the_layer_starts_as_the_identity():
    torch.manual_seed(0)
    x = torch.randn(2, 7, 128)
    torch.testing.assert_close(PrefixAttention(128)(x), x, rtol=0, atol=0)


def test_a_position_reads_no_later_one_and_no_padding():
    torch.manual_seed(0)
    layer = PrefixAttention(128)
    torch.nn.init.normal_(layer.out.weight, std=0.1)  # a trained layer: no longer the identity
    feats = features([5, 3])
    spans = sample_spans(feats)
    assert spans == [(0, 5), (5, 8)]
    x, where = padded(feats.hidden, spans)
    assert x.shape == (2, 5, 128) and where.tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    together = transformed(layer, feats, spans).hidden
    alone = torch.cat([layer(feats.hidden[a:b].float()[None])[0] for a, b in spans])  # no padding at all
    torch.testing.assert_close(together, alone)
    later = feats.hidden.clone()
    later[3:5] += 1.0  # the first answer's last two positions change ...
    moved = transformed(layer, replace(feats, hidden=later), spans).hidden
    torch.testing.assert_close(moved[:3], together[:3])  # ... and the positions before them read the same
    assert not torch.allclose(moved[3:5], together[3:5])
