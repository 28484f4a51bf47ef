"""Global lattice rescoring with n-gram LMs over token ids (the paper's "n-gram BPD" and "p-best n-gram BPD").

The heads predict each position independently, so their best path is often incoherent ("the the",
"Lionel Ronaldo"). An n-gram LM over the base model's token ids knows which neighbours go together.
`NgramRescorer` searches the lattice for the p best paths under

    score(path) = sum_i [ log q_i(w_i) + alpha * log P_kenlm(w_i | w_<i) ]
    q_i(w)      = (1 - lam) * p_head_i(w) + lam * p_context(w | w_<i)

p_head_i is head i's probability (0 outside its top-k). p_context (`ContextNgram`, beyond the paper) is
a count model of the prompt and the text generated so far: where the current suffix occurred before, it
proposes the token that followed, so copied spans (summaries, RAG answers, code edits) are drafted as
prompt-lookup decoding would, inside the same search; its proposals are added to the lattice as extra
arcs. q_i doubles as the per-token acceptance estimate the drafter sizes trees with.

Search: a beam over (KenLM state, context history) per position, best first. An expansion scores at most
`beam score + log q + alpha * (the token's best log-prob in any n-gram of the file)`: candidates are
visited in descending order of that bound and the loop stops as soon as it cannot enter the beam, which
skips most KenLM calls.
"""

from __future__ import annotations

import gzip
import heapq
import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch

from ..lattice import Lattice, ScoredPath
from ..vocab import model_vocab_size, tokenizer_fingerprint

LN10 = math.log(10.0)
NGRAM_METADATA = "ngram.json"
SPECIAL_WORDS = ("<s>", "</s>", "<unk>")


def _open_text(path: Path):
    with open(path, "rb") as f:
        magic = f.read(2)
    return gzip.open(path, "rt", encoding="utf-8") if magic == b"\x1f\x8b" else open(path, encoding="utf-8")


def arpa_unigrams(path: Path) -> list[str]:
    """The unigram words of an ARPA file (plain or gzip), read without loading the higher orders."""
    words: list[str] = []
    try:
        with _open_text(path) as f:
            line = f.readline()
            while line and not line.strip():
                line = f.readline()
            if line.strip() != "\\data\\":
                raise ValueError(f"{path} is not an ARPA n-gram file (first line {line.strip()[:40]!r}, not \\data\\)")
            for line in f:
                if line.strip() == "\\1-grams:":
                    break
            for line in f:
                line = line.strip()
                if not line:
                    continue
                if line.startswith("\\"):
                    break
                parts = line.split("\t")
                if len(parts) < 2:
                    raise ValueError(f"{path}: malformed unigram line {line[:60]!r}")
                words.append(parts[1])
    except (OSError, EOFError, UnicodeDecodeError, gzip.BadGzipFile) as e:
        raise ValueError(f"{path} is not a readable ARPA n-gram file: {e}") from e
    return words


class NgramLM:
    """A KenLM model whose words are the base model's token ids written in decimal.

    Loading checks what would otherwise fail silently: every word must be a token id below `vocab_size`
    (or <s>, </s>, <unk>); <unk> must exist (KenLM otherwise scores unknown ids log10 P = -100, which
    removes any path through them); a metadata file beside it (`ngram.json`, written by
    `hf-bpd train-ngram`) must agree on vocabulary size and tokenizer.
    """

    def __init__(
        self, path: str | Path, vocab_size: int | None = None, tokenizer=None, check_words: bool = True
    ) -> None:
        try:
            import kenlm
        except ImportError as e:
            raise ImportError("n-gram rescoring needs KenLM's Python module: pip install 'hf_bpd[kenlm]'") from e

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"n-gram file {self.path} does not exist")
        meta_path = self.path.parent / NGRAM_METADATA
        self.metadata = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        meta_vocab = self.metadata.get("vocab_size")
        if vocab_size is not None and meta_vocab is not None and meta_vocab != vocab_size:
            raise ValueError(
                f"n-gram {self.path} was trained for a vocabulary of {meta_vocab} tokens, the model has {vocab_size}"
            )
        fingerprint = self.metadata.get("tokenizer_fingerprint")
        if tokenizer is not None and fingerprint and fingerprint != tokenizer_fingerprint(tokenizer):
            raise ValueError(f"n-gram {self.path} was trained with another tokenizer than the one given")
        vocab_size = vocab_size or meta_vocab
        if check_words:
            words = arpa_unigrams(self.path)
            if "<unk>" not in words:
                raise ValueError(
                    f"n-gram {self.path} has no <unk>: KenLM would score every unseen token id log10 P = -100; "
                    "retrain it with `hf-bpd train-ngram` (which adds <unk>)"
                )
            bad = [
                w for w in words if w not in SPECIAL_WORDS and not (w.isdigit() and int(w) < (vocab_size or 1 << 62))
            ]
            if bad:
                raise ValueError(
                    f"n-gram {self.path} is not over this model's token ids (vocabulary {vocab_size}): words such as "
                    f"{bad[:3]} are not token ids below it"
                )
        config = kenlm.Config()
        config.arpa_complain = kenlm.ARPALoadComplain.NONE
        try:
            self.model = kenlm.Model(str(self.path), config)
        except (OSError, RuntimeError) as e:
            raise ValueError(f"n-gram {self.path} is corrupt or not an ARPA/KenLM file: {e}") from e
        self.order = self.model.order
        self.vocab_size = vocab_size
        self._words = [str(i) for i in range(vocab_size)] if vocab_size else None
        self._upper: list[float] | None = None

    def upper_bound(self, token: int) -> float:
        """Highest natural-log probability `token` has in any explicit n-gram of the file (the search's
        look-ahead). Not a strict bound: back-off weights above 1 can exceed it, so the beam search is
        nearly, not exactly, exhaustive."""
        if self._upper is None:
            best: dict[int, float] = {}
            with _open_text(self.path) as f:
                for line in f:
                    parts = line.split("\t", 2)
                    if len(parts) < 2:
                        continue
                    word = parts[1].rstrip("\n").rsplit(" ", 1)[-1]
                    if word.isdigit():
                        t, lp = int(word), float(parts[0])
                        if lp > best.get(t, -99.0):
                            best[t] = lp
            unk = self.model.score("<unk>", bos=False, eos=False) * LN10
            size = max(self.vocab_size or 0, max(best, default=-1) + 1)
            self._upper = [unk] * size
            for t, lp in best.items():
                self._upper[t] = lp * LN10
        return self._upper[token] if token < len(self._upper) else self._upper[0]

    def word(self, token: int) -> str:
        return self._words[token] if self._words is not None and token < len(self._words) else str(token)

    def state_after(self, tokens: Sequence[int]):
        """KenLM state after the last order-1 `tokens` (the accepted context)."""
        import kenlm

        state = kenlm.State()
        self.model.NullContextWrite(state)
        for token in tokens[-(self.order - 1) :] if self.order > 1 else []:
            out = kenlm.State()
            self.model.BaseScore(state, self.word(int(token)), out)
            state = out
        return state

    def score(self, state, token: int):
        """(natural-log probability of `token` after `state`, the state after it)."""
        import kenlm

        out = kenlm.State()
        return self.model.BaseScore(state, self.word(token), out) * LN10, out

    def sequence_logprob(self, tokens: Sequence[int], context: Sequence[int] = ()) -> float:
        state = self.state_after(list(context))
        total = 0.0
        for t in tokens:
            lp, state = self.score(state, int(t))
            total += lp
        return total


class ContextNgram:
    """Counts of the n-grams in the accepted sequence (prompt + generated so far), updated incrementally.

    `predict(history)` returns {token: probability} from the longest suffix of `history` (up to
    order - 1 tokens, at least `min_match`) seen before: the relative frequencies of what followed it.

    It also keeps score of itself: before each new token is counted, its most frequent continuation for
    the longest matching suffix is checked against it, per match length. `accuracy(n)` (with a uniform
    Beta prior) is then this sequence's own measured chance that a prediction from an n-token match is
    right: the acceptance estimate of tokens drafted from the context alone.
    """

    def __init__(self, order: int = 4, min_match: int = 1) -> None:
        if order < 2 or not 1 <= min_match < order:
            raise ValueError(f"ContextNgram needs order >= 2 and 1 <= min_match < order, got {order}, {min_match}")
        self.order = order
        self.min_match = min_match
        self.reset()

    def reset(self) -> None:
        self.tokens: list[int] = []
        self.counts: dict[tuple[int, ...], dict[int, int]] = {}
        self.hits = [0] * self.order
        self.attempts = [0] * self.order

    def accuracy(self, match: int) -> float:
        return (self.hits[match] + 1) / (self.attempts[match] + 2)

    def _longest_match(self, history: Sequence[int]) -> tuple[dict[int, int], int] | None:
        """(continuation counts, match length) of the longest suffix of `history` seen before, or None."""
        for n in range(min(self.order - 1, len(history)), self.min_match - 1, -1):
            table = self.counts.get(tuple(history[-n:]))
            if table:
                return table, n
        return None

    def best(self, history: Sequence[int]) -> tuple[int, int] | None:
        """(most frequent continuation, match length) for the longest matching suffix, or None."""
        match = self._longest_match(history)
        return (max(match[0], key=match[0].get), match[1]) if match else None

    def update(self, sequence: Sequence[int]) -> None:
        """Bring the counts up to `sequence`; starts over when it does not extend what was seen."""
        seen = len(self.tokens)
        if len(sequence) < seen or (seen and int(sequence[seen - 1]) != self.tokens[-1]):
            self.reset()
            seen = 0
        for i in range(seen, len(sequence)):
            token = int(sequence[i])
            guess = self.best(self.tokens)
            if guess is not None:
                self.attempts[guess[1]] += 1
                self.hits[guess[1]] += guess[0] == token
            for n in range(1, self.order):
                if len(self.tokens) >= n:
                    hist = tuple(self.tokens[-n:])
                    table = self.counts.setdefault(hist, {})
                    table[token] = table.get(token, 0) + 1
            self.tokens.append(token)

    def predict(self, history: Sequence[int]) -> dict[int, float]:
        match = self._longest_match(history)
        if not match:
            return {}
        total = sum(match[0].values())
        return {t: c / total for t, c in match[0].items()}


def _logsumexp(values: list[float]) -> float:
    top = max(values)
    return top + math.log(sum(math.exp(v - top) for v in values)) if top > -math.inf else top


class NgramRescorer:
    """p-best lattice search with a KenLM n-gram (`lm`), a context n-gram (`context_weight` > 0), or both.

    alpha:          weight of the KenLM log-probability (0 or lm=None: no KenLM).
    context_weight: lam, the context model's share in the drafting distribution q (0: no context model).
    num_paths:      p, distinct full-length drafts returned (p = 1: n-gram BPD; p > 1: p-best).
    beam:           hypotheses kept per position (>= num_paths).
    """

    def __init__(
        self,
        lm: NgramLM | None = None,
        alpha: float = 0.5,
        num_paths: int = 1,
        beam: int = 16,
        context_weight: float = 0.0,
        context_order: int = 4,
        context_proposals: int = 2,
        context_extend: int = 0,
        context_extend_match: int = 2,
    ) -> None:
        if lm is None and context_weight <= 0:
            raise ValueError("NgramRescorer needs an n-gram LM, a context_weight > 0, or both")
        if num_paths < 1 or beam < num_paths:
            raise ValueError(f"need 1 <= num_paths <= beam, got num_paths={num_paths}, beam={beam}")
        if not 0.0 <= context_weight < 1.0:
            raise ValueError(f"context_weight must be in [0, 1), got {context_weight}")
        if alpha < 0:
            raise ValueError(f"alpha must be >= 0, got {alpha}")
        self.lm = lm
        self.alpha = alpha if lm is not None else 0.0
        self.num_paths = num_paths
        self.beam = beam
        self.context_weight = context_weight
        self.context = [ContextNgram(context_order)] if context_weight > 0 else None
        self.context_proposals = context_proposals
        self.context_extend = context_extend
        self.context_extend_match = context_extend_match
        self._cache: dict = {}

    def bind(self, model) -> None:
        """Called by the drafter with the base model: the n-gram must be over its vocabulary."""
        vocab = model_vocab_size(model)
        if self.lm is not None and self.lm.vocab_size is not None and self.lm.vocab_size != vocab:
            raise ValueError(
                f"n-gram {self.lm.path} is over {self.lm.vocab_size} token ids, the model has {vocab}: "
                "it was trained for another tokenizer"
            )
        if self.lm is not None and self.alpha > 0:
            self.lm.upper_bound(0)  # read the look-ahead table now, not in the first decoding step

    def reset(self) -> None:
        if self.context is not None:
            for c in self.context:
                c.reset()

    def _context_model(self, b: int) -> ContextNgram:
        while len(self.context) <= b:
            self.context.append(ContextNgram(self.context[0].order))
        return self.context[b]

    def __call__(self, lattice: Lattice, context: torch.Tensor) -> list[list[ScoredPath]]:
        ctx_rows = context.tolist()
        return [self.search(lattice, b, ctx_rows[b]) for b in range(lattice.batch_size)]

    def search(self, lattice: Lattice, b: int, accepted: list[int]) -> list[ScoredPath]:
        tokens, logprobs = lattice.row(b)
        lam = self.context_weight
        ctx_model = None
        if self.context is not None:
            ctx_model = self._context_model(b)
            ctx_model.update(accepted)
        hist_len = ctx_model.order - 1 if ctx_model is not None else 0
        lm, alpha = self.lm, self.alpha
        root_state = lm.state_after(accepted) if lm is not None and alpha > 0 else None
        root_history = tuple(accepted[-hist_len:]) if hist_len else ()
        # A hypothesis is a tuple (score, acceptance log-probs, tokens, KenLM state, context history):
        # tuples, not objects, because this loop is the rescorer's whole cost.
        beam = [(0.0, (), (), root_state, root_history)]
        log_keep = math.log1p(-lam) if lam > 0 else 0.0
        width = self.beam
        lm_score, cache = self._lm_score, self._cache
        for i in range(lattice.num_positions):
            head_arcs = self._sorted_arcs([(lp + log_keep, t) for lp, t in zip(logprobs[i], tokens[i])], root_state)
            # Candidates (hypothesis h, its arc j) by an upper bound on their score: the head/context part
            # is exact and alpha * log P_kenlm is at most alpha * (the token's best n-gram log-prob). With
            # hypotheses and arcs both in descending order, (h, j) is beaten by every (h' <= h, j' <= j),
            # so only pairs with (h + 1) * (j + 1) <= beam can be among the beam best bounds.
            candidates = []
            for h, hyp in enumerate(beam):
                arcs = (
                    head_arcs
                    if ctx_model is None
                    else self._context_arcs(head_arcs, ctx_model, hyp[4], lam, root_state)
                )
                base = hyp[0]
                for a in arcs[: width // (h + 1)]:
                    candidates.append((base + a[2], h, a))
            candidates.sort(key=lambda c: -c[0])
            kept: list = []  # min-heap of (score, tiebreak, hypothesis)
            floor = -math.inf  # the beam's worst kept score once it is full
            for n, (bound, h, arc) in enumerate(candidates):
                if bound <= floor:
                    break  # (nearly) nothing left can enter the beam
                score, accept, toks, state, history = beam[h]
                logq, t = arc[0], arc[1]
                score += logq
                if state is not None:
                    hit = cache.get((state, t))
                    lp, state = hit if hit is not None else lm_score(state, t)
                    score += alpha * lp
                if score <= floor:
                    continue
                new = (score, accept + (logq,), toks + (t,), state, (history + (t,))[-hist_len:] if hist_len else ())
                if len(kept) < width:
                    heapq.heappush(kept, (score, n, new))
                    if len(kept) == width:
                        floor = kept[0][0]
                else:
                    heapq.heapreplace(kept, (score, n, new))
                    floor = kept[0][0]
            kept.sort(key=lambda e: (-e[0], e[1]))
            beam = [e[2] for e in kept]
        best = beam[: self.num_paths]
        if root_state is None:  # q is the drafting distribution itself: its log-probs are the estimates
            paths = [ScoredPath(hyp[2], hyp[0], hyp[1]) for hyp in best]
        else:
            start = (root_state, root_history)
            estimates = self._acceptance_estimates([hyp[2] for hyp in best], tokens, logprobs, start, ctx_model)
            paths = [ScoredPath(hyp[2], hyp[0], est) for hyp, est in zip(best, estimates)]
        if ctx_model is not None and self.context_extend > 0:
            paths = [self._extend(path, accepted, ctx_model) for path in paths]
        return paths

    def _extend(self, path: ScoredPath, accepted: list[int], ctx_model: ContextNgram) -> ScoredPath:
        """Continue a draft past the heads' h positions with the context's own continuation while it
        matches at least `context_extend_match` tokens, as prompt-lookup decoding drafts a copied span.
        Each added token's acceptance estimate is the context model's measured accuracy at that match
        length on this very sequence."""
        seq = accepted + list(path.tokens)
        tokens, estimates = list(path.tokens), list(path.token_logprobs or [])
        for _ in range(self.context_extend):
            guess = ctx_model.best(seq[-(ctx_model.order - 1) :])
            if guess is None or guess[1] < self.context_extend_match:
                break
            tokens.append(guess[0])
            estimates.append(math.log(ctx_model.accuracy(guess[1])))
            seq.append(guess[0])
        return ScoredPath(tuple(tokens), path.score, tuple(estimates) if path.token_logprobs is not None else None)

    def _acceptance_estimates(self, paths, tokens, logprobs, start, ctx_model) -> list[tuple[float, ...]]:
        """Per-token acceptance log-probability of each path under the rescored distribution: at each
        position, q's mass on the arcs shared out in proportion to q(w) * P_kenlm(w | history)**alpha
        (the product of experts the search maximises), so drafts the n-gram favours rank higher in the
        tree than the heads alone would put them. Prefixes shared by paths are computed once."""
        lam, alpha = self.context_weight, self.alpha
        log_keep = math.log1p(-lam) if lam > 0 else 0.0
        hist_len = ctx_model.order - 1 if ctx_model is not None else 0
        heads = [
            self._sorted_arcs([(lp + log_keep, a) for lp, a in zip(logprobs[i], tokens[i])], None)
            for i in range(len(tokens))
        ]
        memo: dict[tuple[int, ...], tuple[float, object, tuple[int, ...]]] = {}
        out = []
        for path in paths:
            state, history = start
            est = []
            for i, t in enumerate(path):
                key = path[: i + 1]
                if key not in memo:
                    arcs = [(logq, a) for logq, a, _ in self._context_arcs(heads[i], ctx_model, history, lam, None)]
                    scored = {a: logq + alpha * self._lm_score(state, a)[0] for logq, a in arcs}
                    mass = _logsumexp([logq for logq, _ in arcs])
                    if t not in scored:  # cannot happen for paths of this search; keep the estimate finite
                        scored[t] = -math.inf
                    memo[key] = (
                        mass + scored[t] - _logsumexp(list(scored.values())),
                        self._lm_score(state, t)[1],
                        (history + (t,))[-hist_len:] if hist_len else (),
                    )
                lp, state, history = memo[key]
                est.append(lp)
            out.append(tuple(est))
        return out

    def _sorted_arcs(self, arcs: list[tuple[float, int]], lm_state) -> list[tuple[float, int, float]]:
        """(log q, token, log q + alpha * best n-gram log-prob of token), in descending bound order."""
        if lm_state is None:
            return [(logq, t, logq) for logq, t in arcs]  # already sorted
        out = [(logq, t, logq + self.alpha * self.lm.upper_bound(t)) for logq, t in arcs]
        out.sort(key=lambda a: -a[2])
        return out

    def _context_arcs(self, head_arcs, ctx_model, history, lam, lm_state) -> list[tuple[float, int, float]]:
        """One hypothesis's arcs: the heads' (shared), or with the context model's probability mixed in
        and its best proposals added where its history was seen before."""
        pred = ctx_model.predict(history) if ctx_model is not None else None
        if not pred:
            return head_arcs
        proposals = sorted(pred, key=pred.get, reverse=True)[: self.context_proposals]
        head_p = {t: math.exp(logq) for logq, t, _ in head_arcs}
        boosted = {t for t in pred if t in head_p} | set(proposals)
        arcs = [(logq, t) for logq, t, _ in head_arcs if t not in boosted]
        arcs += [(math.log(head_p.get(t, 0.0) + lam * pred.get(t, 0.0)), t) for t in boosted]
        arcs.sort(key=lambda a: -a[0])
        return self._sorted_arcs(arcs, lm_state)

    def _lm_score(self, state, token: int):
        """KenLM transition, memoised: the same contexts recur across hypotheses and steps."""
        key = (state, token)
        hit = self._cache.get(key)
        if hit is None:
            if len(self._cache) > 200_000:
                self._cache.clear()
            hit = self._cache[key] = self.lm.score(state, token)
        return hit
