"""Retrieval drafts: chains looked up in a corpus of the base model's own answers (REST, He et al. 2024).

A small model answers with stock phrases ("Here are some tips to help you ...", list scaffolding, closing
lines) that recur across prompts but are not in the current context, where `lookup.py` finds its chains.
The corpus is the model's own distilled greedy answers, so its continuations are what the model tends to
say. The context's last n tokens (the longest n <= `max_ngram` found in the corpus) select every corpus
position that follows them; what followed them there is a tree of continuations, each arc estimated by its
token's share of the positions still matching (add-one smoothed, so that a single match is not taken for
certainty), of which the most frequent nodes are drafted. Arcs are calibrated per match length (sources
"corpus1", ...), and the chains compete with the heads' nodes and the context's chain like any draft: they
only decide what is verified, never a token.

The index is a suffix array of the corpus read backwards (`CorpusIndex`): the longest match is a few binary
searches, in three int32 arrays the corpus' length (it, its reverse, the suffix array).
"""

from __future__ import annotations

import heapq
import itertools
import math
from pathlib import Path

import numpy as np

SEPARATOR = -1  # between answers: no match spans it and no chain crosses it
_PAST_END = -2  # what the reversed corpus reads past its end when sorting


def corpus_source(ngram: int) -> str:
    """Calibration source of chain arcs found by a corpus match of length `ngram`."""
    return f"corpus{ngram}"


class CorpusIndex:
    """Index of answers (lists of token ids) for `continuations`: the suffix array of the reversed corpus,
    sorted on each suffix's first `max_ngram` tokens. A context's last tokens read backwards are a prefix of
    those suffixes, so each further token of a match narrows the range of the previous one by two binary
    searches, and the longest match is found without a table per n-gram length."""

    def __init__(self, tokens: np.ndarray, max_ngram: int = 6, max_matches: int = 4096) -> None:
        """`tokens`: the answers' token ids, each answer followed by `SEPARATOR` (`from_answers` builds it)."""
        if max_ngram < 1 or max_matches < 1:
            raise ValueError(f"max_ngram and max_matches must be >= 1, got {max_ngram}, {max_matches}")
        self.tokens = np.asarray(tokens, dtype=np.int32)
        if self.tokens.ndim != 1 or (self.tokens.size and self.tokens[-1] != SEPARATOR):
            raise ValueError("a corpus is one sequence of token ids whose every answer ends with SEPARATOR (-1)")
        if self.tokens.size and self.tokens.min() < SEPARATOR:
            raise ValueError(f"corpus token ids must be >= 0 (or SEPARATOR), got {int(self.tokens.min())}")
        self.max_ngram = max_ngram
        self.max_matches = max_matches
        self._reversed = np.concatenate([self.tokens[::-1], np.full(max_ngram, _PAST_END, np.int32)])
        length = len(self.tokens)
        columns = [self._reversed[k : k + length] for k in range(max_ngram)]
        self._suffixes = np.lexsort(columns[::-1]).astype(np.int32)  # the first token is the primary key
        # where the suffixes starting with token t begin: the first narrowing without a search of all of them
        self._starts = np.concatenate([[0], np.cumsum(np.bincount(self.tokens.astype(np.int64) + 1))])

    @classmethod
    def from_answers(cls, answers, **kwargs) -> CorpusIndex:
        """The index of `answers`, lists of token ids (a model's distilled answers)."""
        parts = []
        for answer in answers:
            parts.extend(int(t) for t in answer)
            parts.append(SEPARATOR)
        return cls(np.asarray(parts, dtype=np.int32), **kwargs)

    def save(self, path: str | Path) -> None:
        """The corpus and its settings in one compressed `.npz` file; the index is rebuilt by `load`."""
        np.savez_compressed(path, tokens=self.tokens, max_ngram=self.max_ngram, max_matches=self.max_matches)

    @classmethod
    def load(cls, path: str | Path) -> CorpusIndex:
        """The index of a corpus `save` wrote."""
        with np.load(path) as saved:
            return cls(saved["tokens"], int(saved["max_ngram"]), int(saved["max_matches"]))

    def __len__(self) -> int:
        return int((self.tokens != SEPARATOR).sum())

    def matches(self, context: np.ndarray) -> tuple[np.ndarray, int]:
        """End positions in the corpus of the context's last n tokens, for the longest n <= `max_ngram` that
        occurs (at most `max_matches` of them, evenly spaced over the corpus: the answers are in the order
        of their data sets), and n; (empty, 0) when not even the last token occurs."""
        row = int(context[-1]) + 1 if len(context) else -1  # the last token's row of `_starts`
        if not 0 < row < len(self._starts) - 1 or self._starts[row] == self._starts[row + 1]:
            return np.zeros(0, np.int64), 0
        lo, hi, n = int(self._starts[row]), int(self._starts[row + 1]), 1
        for k in range(1, min(self.max_ngram, len(context))):
            column = self._reversed[self._suffixes[lo:hi] + k]  # sorted: the range shares its first k tokens
            token = context[len(context) - 1 - k]
            start, stop = np.searchsorted(column, token, "left"), np.searchsorted(column, token, "right")
            if start == stop:
                break
            lo, hi, n = lo + start, lo + stop, k + 1
        ends = np.sort(len(self.tokens) - 1 - self._suffixes[lo:hi].astype(np.int64))
        if ends.size > self.max_matches:
            ends = ends[np.linspace(0, ends.size - 1, self.max_matches).round().astype(np.int64)]
        return ends, n

    def continuations(self, context, max_depth: int, max_nodes: int) -> tuple[list[tuple[list[int], list[float]]], int]:
        """The corpus' tree of continuations after the context's last tokens, grown best first by path
        frequency up to `max_nodes` nodes and `max_depth` tokens, as its root-to-leaf chains (tokens, each
        arc's log-probability estimate: the token's share of the positions still matching, add-one smoothed),
        most probable first, and the match length n; ([], 0) when the context's last token never occurs."""
        ends, n = self.matches(np.asarray(context, dtype=np.int64))
        if not ends.size or max_depth < 1 or max_nodes < 1:
            return [], n
        return continuation_tree(self.tokens, ends, max_depth, max_nodes), n


def continuation_tree(
    tokens: np.ndarray, ends: np.ndarray, max_depth: int, max_nodes: int
) -> list[tuple[list[int], list[float]]]:
    """The tree of what followed the positions `ends` (ascending) of `tokens` (one token sequence, with
    `SEPARATOR` where no chain may cross and after its end), grown best first by path frequency up to
    `max_nodes` nodes and `max_depth` tokens, as its root-to-leaf chains (tokens, each arc's log-probability
    estimate: the token's share of the positions still matching, add-one smoothed), most probable first.
    Equally frequent children go to the one that followed the latest of `ends` first."""
    candidates: list = []  # heap of (-path logprob, tie order, tokens, arc logprobs, match ends)
    order = itertools.count()

    def offer_children(path: list[int], logprobs: list[float], ends: np.ndarray) -> None:
        following = tokens[ends + 1]
        real = following[following != SEPARATOR][::-1]  # latest first: `ends` ascend
        values, latest_first, counts = np.unique(real, return_index=True, return_counts=True)
        best = np.lexsort((latest_first, -counts))[:max_nodes]  # no node grows more children than that
        for token, count in zip(values[best].tolist(), counts[best].tolist()):
            lp = math.log(count / (ends.size + 1))
            arcs, matching = [*logprobs, lp], ends[following == token] + 1
            heapq.heappush(candidates, (-sum(arcs), next(order), [*path, token], arcs, matching))

    offer_children([], [], ends)
    grown, parents = [], set()
    while candidates and len(grown) < max_nodes:
        _, _, path, logprobs, matching = heapq.heappop(candidates)
        grown.append((path, logprobs))
        parents.add(tuple(path[:-1]))
        if len(path) < max_depth:
            offer_children(path, logprobs, matching)
    leaves = [(path, logprobs) for path, logprobs in grown if tuple(path) not in parents]
    return sorted(leaves, key=lambda chain: -sum(chain[1]))
