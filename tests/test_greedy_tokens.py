"""`accept.greedy_tokens`, the greedy token of every tree node, must be plain `generate`'s
`argmax(dim=-1)` exactly, ties and non-finite scores included: it is what keeps hf_bpd's greedy output
identical."""

from __future__ import annotations

import pytest
import torch

from hf_bpd.decode.accept import greedy_tokens


@pytest.mark.parametrize("threads", [1, 2])
def test_greedy_tokens_is_argmax_with_ties_nan_and_infinities(threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(threads)
        for trial in range(60):
            rows = int(torch.randint(1, 18, (1,), generator=g))
            vocab = int(torch.randint(1, 270_000, (1,), generator=g))
            levels = int(torch.randint(1, 40, (1,), generator=g))  # few distinct values: ties everywhere
            scores = torch.randint(0, levels, (rows, vocab), generator=g).float()
            if trial % 3 == 0:
                scores[0, int(torch.randint(0, vocab, (1,), generator=g))] = float("nan")
            if trial % 4 == 0:
                scores[-1] = float("-inf")  # a processor that masked every token of a row
            if trial % 5 == 0:
                scores[0, : vocab // 2] = float("inf")
            assert torch.equal(greedy_tokens(scores), scores.argmax(dim=-1))
            # the slices decoding takes: a batch's first nodes, a strided view
            assert torch.equal(greedy_tokens(scores[: max(rows // 2, 1)]), scores[: max(rows // 2, 1)].argmax(dim=-1))
            assert torch.equal(greedy_tokens(scores[:, ::3]), scores[:, ::3].argmax(dim=-1))
        for dtype in (torch.bfloat16, torch.float16):
            scores = torch.randint(0, 5, (7, 49152), generator=g).to(dtype)
            assert torch.equal(greedy_tokens(scores), scores.argmax(dim=-1))
    finally:
        torch.set_num_threads(before)
