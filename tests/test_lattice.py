"""The top-k lattice: construction from logits, best-first prefix search and k-best full paths against
brute force, and the oracle accepted length."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from hf_bpd import Lattice, ScoredPath


def random_lattice(batch: int, h: int, k: int, vocab: int = 11, seed: int = 0) -> Lattice:
    g = torch.Generator().manual_seed(seed)
    return Lattice.from_logits(torch.randn(batch, h, vocab, generator=g) * 2.0, top_k=k)


def brute_prefixes(lat: Lattice, b: int, max_depth: int | None = None) -> list[ScoredPath]:
    """Every prefix (length 1..depth) of row b, scored by its summed logprob, best first."""
    tokens, logprobs = lat.row(b)
    depth = lat.num_positions if max_depth is None else min(max_depth, lat.num_positions)
    out = []
    for d in range(1, depth + 1):
        for ranks in itertools.product(range(lat.top_k), repeat=d):
            out.append(
                ScoredPath(
                    tuple(tokens[i][r] for i, r in enumerate(ranks)),
                    sum(logprobs[i][r] for i, r in enumerate(ranks)),
                )
            )
    return sorted(out, key=lambda p: -p.score)


def brute_paths(lat: Lattice, b: int) -> list[ScoredPath]:
    return [p for p in brute_prefixes(lat, b) if len(p.tokens) == lat.num_positions]


def lookup_score(lat: Lattice, b: int, path: tuple[int, ...]) -> float:
    """The summed logprob of a token path (tokens are unique per position in a top-k row)."""
    tokens, logprobs = lat.row(b)
    return sum(logprobs[i][tokens[i].index(t)] for i, t in enumerate(path))


# ---------------------------------------------------------------------------------------------- from_logits


def test_from_logits_shapes_sorted_and_logsoftmax():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 4, 13, generator=g)
    lat = Lattice.from_logits(logits, top_k=5)
    assert lat.tokens.shape == lat.logprobs.shape == (2, 4, 5)
    assert (lat.batch_size, lat.num_positions, lat.top_k) == (2, 4, 5)
    assert lat.tokens.dtype == torch.long
    assert lat.logprobs.dtype == torch.float32
    # Sorted by descending log-probability.
    assert (lat.logprobs[..., :-1] >= lat.logprobs[..., 1:]).all()
    # Values are the log-softmax over the FULL vocabulary at the chosen tokens.
    full = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(lat.logprobs, full.gather(-1, lat.tokens))
    # They are the top-5: the 5th is >= every token left out.
    for b in range(2):
        for i in range(4):
            left_out = [v for v in range(13) if v not in lat.tokens[b, i].tolist()]
            assert full[b, i, left_out].max() <= lat.logprobs[b, i, -1]
            assert len(set(lat.tokens[b, i].tolist())) == 5
    # Top-1 is the argmax; log-probabilities are <= 0.
    assert torch.equal(lat.tokens[..., 0], logits.argmax(-1))
    assert (lat.logprobs <= 0).all()


def test_from_logits_half_precision_is_float32():
    logits = torch.randn(1, 2, 7).to(torch.bfloat16)
    lat = Lattice.from_logits(logits, top_k=3)
    assert lat.logprobs.dtype == torch.float32
    torch.testing.assert_close(lat.logprobs, torch.log_softmax(logits.float(), -1).gather(-1, lat.tokens))


def test_from_logits_full_vocab_sums_to_one():
    logits = torch.randn(1, 3, 6)
    lat = Lattice.from_logits(logits, top_k=6)
    torch.testing.assert_close(lat.logprobs.exp().sum(-1), torch.ones(1, 3))


def test_from_logits_token_ids_map_draft_vocabulary():
    # Logits over a 4-token draft vocabulary whose index i stands for token id token_ids[i].
    logits = torch.tensor([[[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 4.0]]])
    token_ids = torch.tensor([40, 10, 30, 20])
    lat = Lattice.from_logits(logits, top_k=2, token_ids=token_ids)
    assert lat.tokens.tolist() == [[[10, 20], [40, 20]]]
    plain = Lattice.from_logits(logits, top_k=2)
    assert plain.tokens.tolist() == [[[1, 3], [0, 3]]]
    assert torch.equal(lat.logprobs, plain.logprobs)


@pytest.mark.parametrize("top_k", [0, -1, 14])
def test_from_logits_top_k_out_of_range(top_k):
    with pytest.raises(ValueError, match="top_k"):
        Lattice.from_logits(torch.randn(1, 2, 13), top_k=top_k)


def test_mismatched_shapes_raise():
    with pytest.raises(ValueError, match="same shape"):
        Lattice(tokens=torch.zeros(1, 2, 3, dtype=torch.long), logprobs=torch.zeros(1, 2, 4))
    with pytest.raises(ValueError, match="same shape"):
        Lattice(tokens=torch.zeros(2, 3, dtype=torch.long), logprobs=torch.zeros(2, 3))


# ---------------------------------------------------------------------------------------------- best_prefixes


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("n", [1, 2, 5, 13, 39])
def test_best_prefixes_matches_brute_force(seed, n):
    lat = random_lattice(batch=2, h=3, k=3, seed=seed)
    for b in range(2):
        got = lat.best_prefixes(b, n)
        want = brute_prefixes(lat, b)
        assert len(got) == n
        assert len({p.tokens for p in got}) == n, "duplicate prefix"
        # Same multiset of scores as the brute-force top n (ties: scores, not tokens).
        assert [p.score for p in got] == pytest.approx([p.score for p in want[:n]], abs=1e-5)
        # Returned best first, each score is the real score of its tokens.
        assert all(a.score >= c.score - 1e-6 for a, c in itertools.pairwise(got))
        for p in got:
            assert 1 <= len(p.tokens) <= 3
            assert p.score == pytest.approx(lookup_score(lat, b, p.tokens), abs=1e-5)
        # Every prefix's parent came earlier: the result is a tree.
        seen: set[tuple[int, ...]] = set()
        for p in got:
            if len(p.tokens) > 1:
                assert p.tokens[:-1] in seen, (p, seen)
            seen.add(p.tokens)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("max_depth", [1, 2, 3, 7])
def test_best_prefixes_max_depth(seed, max_depth):
    lat = random_lattice(batch=1, h=3, k=3, seed=seed)
    depth = min(max_depth, 3)
    total = sum(3**d for d in range(1, depth + 1))
    for n in (4, total, total + 10):
        got = lat.best_prefixes(0, n, max_depth=max_depth)
        assert max(len(p.tokens) for p in got) <= depth
        want = brute_prefixes(lat, 0, max_depth=max_depth)
        assert len(got) == min(n, total)
        assert [p.score for p in got] == pytest.approx([p.score for p in want[:n]], abs=1e-5)


def test_best_prefixes_returns_all_when_n_too_large():
    lat = random_lattice(batch=1, h=3, k=3, seed=7)
    got = lat.best_prefixes(0, 1000)
    want = brute_prefixes(lat, 0)
    assert len(got) == 3 + 9 + 27
    assert {p.tokens for p in got} == {p.tokens for p in want}
    assert [p.score for p in got] == pytest.approx([p.score for p in want], abs=1e-5)


def test_best_prefixes_empty_cases():
    lat = random_lattice(batch=1, h=3, k=3)
    assert lat.best_prefixes(0, 0) == []
    assert lat.best_prefixes(0, -3) == []
    assert lat.best_prefixes(0, 5, max_depth=0) == []


def test_best_prefixes_first_is_top1_token():
    lat = random_lattice(batch=2, h=3, k=3, seed=2)
    for b in range(2):
        (first,) = lat.best_prefixes(b, 1)
        assert first.tokens == (int(lat.tokens[b, 0, 0]),)
        assert first.score == pytest.approx(float(lat.logprobs[b, 0, 0]))


def test_best_prefixes_hand_built():
    # Position 0: tokens 5 (-0.1) / 6 (-2.0); position 1: tokens 7 (-0.2) / 8 (-0.3).
    lat = Lattice(
        tokens=torch.tensor([[[5, 6], [7, 8]]]),
        logprobs=torch.tensor([[[-0.1, -2.0], [-0.2, -0.3]]]),
    )
    got = lat.best_prefixes(0, 6)
    assert [p.tokens for p in got] == [(5,), (5, 7), (5, 8), (6,), (6, 7), (6, 8)]
    assert [p.score for p in got] == pytest.approx([-0.1, -0.3, -0.4, -2.0, -2.2, -2.3])


def test_best_prefixes_top_k_one_is_a_chain():
    lat = random_lattice(batch=1, h=4, k=1, seed=1)
    got = lat.best_prefixes(0, 10)
    assert [len(p.tokens) for p in got] == [1, 2, 3, 4]
    assert got[-1].tokens == tuple(lat.tokens[0, :, 0].tolist())


# ---------------------------------------------------------------------------------------------- best_paths


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("p", [1, 4, 10, 27])
def test_best_paths_matches_brute_force(seed, p):
    lat = random_lattice(batch=2, h=3, k=3, seed=seed)
    for b in range(2):
        got = lat.best_paths(b, p)
        want = brute_paths(lat, b)
        assert len(want) == 27
        assert len(got) == p
        assert len({q.tokens for q in got}) == p, "duplicate path"
        assert all(len(q.tokens) == 3 for q in got)
        assert [q.score for q in got] == pytest.approx([q.score for q in want[:p]], abs=1e-5)
        for q in got:
            assert q.score == pytest.approx(lookup_score(lat, b, q.tokens), abs=1e-5)


@pytest.mark.parametrize("h,k", [(1, 4), (2, 2), (4, 2), (2, 5)])
def test_best_paths_all_paths_no_duplicates(h, k):
    lat = random_lattice(batch=1, h=h, k=k, seed=h * 10 + k)
    got = lat.best_paths(0, 10**4)
    assert len(got) == k**h
    assert len({q.tokens for q in got}) == k**h
    assert {q.tokens for q in got} == {q.tokens for q in brute_paths(lat, 0)}
    scores = [q.score for q in got]
    assert all(a >= c - 1e-6 for a, c in itertools.pairwise(scores))
    assert scores == pytest.approx(sorted((q.score for q in brute_paths(lat, 0)), reverse=True), abs=1e-5)


def test_best_paths_first_is_argmax_path():
    lat = random_lattice(batch=1, h=3, k=3, seed=4)
    (best,) = lat.best_paths(0, 1)
    assert best.tokens == tuple(lat.tokens[0, :, 0].tolist())
    assert best.score == pytest.approx(float(lat.logprobs[0, :, 0].sum()))
    assert lat.best_paths(0, 0) == []


def test_best_paths_with_ties():
    # All arcs equally likely: every one of the 8 paths has the same score, none repeated.
    lat = Lattice(tokens=torch.tensor([[[1, 2], [3, 4], [5, 6]]]), logprobs=torch.full((1, 3, 2), math.log(0.5)))
    got = lat.best_paths(0, 100)
    assert len(got) == 8
    assert len({q.tokens for q in got}) == 8
    assert all(q.score == pytest.approx(3 * math.log(0.5)) for q in got)


# ---------------------------------------------------------------------------------------------- oracle_length


def hand_lattice() -> Lattice:
    # Row 0: position i holds tokens {10+i, 20+i}; row 1: {30+i, 40+i}. 4 positions, k=2.
    tokens = torch.tensor(
        [
            [[10, 20], [11, 21], [12, 22], [13, 23]],
            [[30, 40], [31, 41], [32, 42], [33, 43]],
        ]
    )
    return Lattice(tokens=tokens, logprobs=torch.full((2, 4, 2), -0.5))


def test_oracle_full_match():
    lat = hand_lattice()
    cont = torch.tensor([[10, 21, 12, 23], [40, 31, 42, 33]])
    assert lat.oracle_length(cont).tolist() == [4, 4]


def test_oracle_mismatch_first_position():
    lat = hand_lattice()
    cont = torch.tensor([[99, 11, 12, 13], [31, 31, 32, 33]])  # row 1: 31 is in position 1, not 0
    assert lat.oracle_length(cont).tolist() == [0, 0]


def test_oracle_mismatch_in_middle_stops_counting():
    lat = hand_lattice()
    # Row 0 misses at position 2 (later positions hit again, but must not count).
    # Row 1 misses at position 1.
    cont = torch.tensor([[20, 11, 99, 13], [30, 99, 32, 33]])
    out = lat.oracle_length(cont)
    assert out.dtype == torch.long
    assert out.shape == (2,)
    assert out.tolist() == [2, 1]


def test_oracle_short_and_long_continuations():
    lat = hand_lattice()
    assert lat.oracle_length(torch.tensor([[10, 11], [30, 41]])).tolist() == [2, 2]
    # A continuation longer than the lattice counts only the lattice positions.
    assert lat.oracle_length(torch.tensor([[10, 11, 12, 13, 14, 15], [30, 31, 32, 99, 0, 0]])).tolist() == [4, 3]


def test_oracle_matches_brute_force_random():
    g = torch.Generator().manual_seed(0)
    lat = random_lattice(batch=4, h=5, k=3, vocab=6, seed=5)
    cont = torch.randint(0, 6, (4, 5), generator=g)
    want = []
    for b in range(4):
        n = 0
        while n < 5 and int(cont[b, n]) in lat.tokens[b, n].tolist():
            n += 1
        want.append(n)
    assert lat.oracle_length(cont).tolist() == want
