"""Context copy: draft heads that can copy from the context (prompt and answer so far).

Medusa-style heads see one hidden state, so they cannot copy a name, a number or a phrase from a long
prompt: on Spec-Bench the copy-heavy categories (translation, summarization, RAG) are where the shipped
heads are weakest. A model-free bigram lookup over the context predicts each head's target about as often
as the heads themselves do, at every depth (docs/history.md), and on other positions: the two are
complementary.

So each head gets a pointer over the context (a pointer-generator, See et al. 2017, in the form of an
induction lookup), learned on the same self-distilled data as the heads:

    memory      every accepted position j >= 1 whose next token x[j+1] is known (the root included):
                key_j = W_k [e(x[j-1]); e(x[j])]            (the bigram ending at j)
                value_j = x[j+1]                           (the token that followed it)
    query       head i, drafting the token after x[t+i] (the token it reads, see `heads.py`):
                q = W_q,i [s_i; e(x[t+i-1])]               (its state, and the token before that)
    attention   a = softmax([q . key_j / sqrt(d) + bias_i(distance) ..., sink_i(s_i; e(x[t+i-1]))])
    output      p(y) = a_sink * p_head(y) + sum_{j: value_j = y} a_j

The sink's weight is the head's own distribution's share, so the head decides per position whether to
copy or to generate, and the output is still a distribution (top-k and calibration work unchanged). A
copied token may lie outside the heads' draft vocabulary: the pointer reaches the whole vocabulary.
Keys depend on token ids only, so decoding needs nothing beyond the token ids it already has (no extra
hidden states, nothing stored across steps); `memory` of a 700-token context costs one small matmul.

`e` is the base model's input embedding, borrowed at `bind` as the heads' token input already is.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import nn

DISTANCE_BUCKETS = 12  # log2 buckets of how far back a key is: 1, 2-3, 4-7, ... 1024+
INITIAL_SINK = 3.0  # sink logit at initialisation: the head's own distribution starts with most weight


@dataclass
class CopyMemory:
    """The context as the pointer sees it: `keys [B, L, d]`, `values [B, L]` (the token after each key's
    bigram), `distance [B, L]` (distance bucket of each key from the context's end), `valid [B, L]`."""

    keys: torch.Tensor
    values: torch.Tensor
    distance: torch.Tensor
    valid: torch.Tensor


@dataclass
class CopyTargets:
    """Teacher-forced positions for training the pointer: `context [n, L]` the accepted tokens x[0..t+1]
    (right-padded to `lengths [n]`), `before [n, h]` the token before the one head i reads (x[t+i]),
    `targets [n, h]` head i's target token id (negative: none) and `head_targets [n, h]` its index in the
    heads' draft vocabulary (negative: outside it)."""

    context: torch.Tensor
    lengths: torch.Tensor
    before: torch.Tensor
    targets: torch.Tensor
    head_targets: torch.Tensor

    def to(self, device: torch.device | str) -> CopyTargets:
        return CopyTargets(*(getattr(self, f.name).to(device) for f in fields(self)))


def distance_bucket(distance: torch.Tensor) -> torch.Tensor:
    """floor(log2(distance)) for distance >= 1, capped at the last bucket."""
    d = distance.clamp(min=1).float()
    return torch.log2(d).floor().long().clamp(max=DISTANCE_BUCKETS - 1)


class ContextCopy(nn.Module):
    """The pointer of every head (module docstring). `dim`: width of keys and queries."""

    def __init__(self, hidden_size: int, num_heads: int, dim: int) -> None:
        super().__init__()
        if dim < 1:
            raise ValueError(f"copy_dim must be >= 1, got {dim}")
        self.dim = dim
        self.key = nn.Linear(2 * hidden_size, dim, bias=False)
        self.query = nn.ModuleList(nn.Linear(2 * hidden_size, dim) for _ in range(num_heads))
        self.sink = nn.ModuleList(nn.Linear(2 * hidden_size, 1) for _ in range(num_heads))
        self.distance_bias = nn.Parameter(torch.zeros(num_heads, DISTANCE_BUCKETS))
        for sink in self.sink:
            sink._bpd_sink_init = True  # `BlockDraftHeads._init_weights`: zero weight, INITIAL_SINK bias

    def memory(self, context: torch.Tensor, embedding: torch.Tensor, lengths: torch.Tensor | None = None) -> CopyMemory:
        """`context [B, L]` token ids (right-padded; `lengths [B]` real lengths, default all L), each row
        ending with its last known token -> the memory of keys j = 1 .. length-2 (values x[j+1])."""
        b, n = context.shape
        if lengths is None:
            lengths = torch.full((b,), n, dtype=torch.long, device=context.device)
        m = max(n - 2, 0)
        if torch.is_grad_enabled():  # training: project the distinct tokens, differentiably
            unique, inverse = context.unique(return_inverse=True)
            prev_part, cur_part = self._key_halves(nn.functional.embedding(unique.to(embedding.device), embedding))
            inverse = inverse.to(prev_part.device)
        else:  # decoding: look both halves up in per-vocabulary tables made once
            prev_part, cur_part = self._key_tables(embedding)
            inverse = context.to(prev_part.device)
        keys = prev_part[inverse[:, :m]] + cur_part[inverse[:, 1 : m + 1]]
        values = context[:, 2 : m + 2]
        j = torch.arange(1, m + 1, device=context.device)
        valid = j[None] <= (lengths[:, None] - 2)
        distance = distance_bucket(lengths[:, None].to(j.device) - 1 - j[None])
        return CopyMemory(keys, values, distance, valid)

    def _key_halves(self, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeddings `[U, H]` -> the parts of a key from its first token and from its second, `[U, d]` each
        (a key is W_k [e(x[j-1]); e(x[j])], so it is the sum of one part per token)."""
        e = e.to(self.key.weight.dtype)
        half = self.key.weight.shape[1] // 2
        return e @ self.key.weight[:, :half].T, e @ self.key.weight[:, half:].T

    def _key_tables(self, embedding: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`_key_halves` of every vocabulary token, made once and remade when the key weight or the
        embedding changes (so each decoding step only gathers rows instead of projecting its context)."""
        stamp = tuple((t.data_ptr(), t._version, t.dtype, t.device) for t in (embedding, self.key.weight))
        cached = self.__dict__.get("_key_table_cache")
        if cached is None or cached[0] != stamp:
            with torch.no_grad():
                cached = (stamp, self._key_halves(embedding.to(self.key.weight.device)))
            self.__dict__["_key_table_cache"] = cached
        return cached[1]

    def _query_sink(self, x: torch.Tensor, i: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's query `[n, d]` and sink logit `[n]` from its head `i [n]`: one matmul over every head's
        weights stacked (rows of several heads never loop over heads)."""
        params = [p for q, s in zip(self.query, self.sink) for p in (q.weight, s.weight, q.bias, s.bias)]
        stamp = tuple((p.data_ptr(), p._version, p.dtype) for p in params)
        cached = self.__dict__.get("_query_sink_cache")
        if torch.is_grad_enabled() or cached is None or cached[0] != stamp:
            weight = torch.cat([torch.cat([q.weight, s.weight]) for q, s in zip(self.query, self.sink)])
            bias = torch.cat([torch.cat([q.bias, s.bias]) for q, s in zip(self.query, self.sink)])
            cached = (stamp, weight, bias)
            if not torch.is_grad_enabled():  # decoding: stacked once, remade if a weight changes
                self.__dict__["_query_sink_cache"] = cached
        _, weight, bias = cached
        out = nn.functional.linear(x, weight, bias).view(x.shape[0], len(self.query), self.dim + 1)
        out = out[torch.arange(x.shape[0], device=x.device), i]
        return out[:, : self.dim], out[:, self.dim]

    def attention(
        self, i: torch.Tensor, state: torch.Tensor, prev_embedding: torch.Tensor, memory: CopyMemory
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """For rows drafting with head `i [n]` (0-based), head state `state [n, H]` and the embedding of the
        token before the one the head read `prev_embedding [n, H]`, over `memory` (one row, shared, or n
        rows): (log weight of the sink `[n]`, log weights of the keys `[n, L]`, -inf where invalid)."""
        x = torch.cat([state, prev_embedding.to(state.dtype)], dim=-1)
        q, sink = self._query_sink(x, i)
        keys = memory.keys.to(q.dtype)
        # one memory shared by every row (drafting), or one per row (training)
        scores = q @ keys[0].T if keys.shape[0] == 1 else torch.einsum("nd,nld->nl", q, keys)
        scores = scores / self.dim**0.5 + self.distance_bias[i[:, None], memory.distance.expand(q.shape[0], -1)]
        scores = scores.masked_fill(~memory.valid.expand(q.shape[0], -1), float("-inf"))
        logits = torch.cat([sink[:, None], scores], dim=-1).float()
        logw = logits.log_softmax(-1)
        return logw[:, 0], logw[:, 1:]


def mixed_logprobs(
    head_logprobs: torch.Tensor,
    draft_vocab: torch.Tensor | None,
    vocab_size: int,
    sink_logw: torch.Tensor,
    key_logw: torch.Tensor,
    values: torch.Tensor,
) -> torch.Tensor:
    """The pointer-generator mixture over the whole vocabulary, `[n, V]` log-probabilities: the head's own
    `head_logprobs [n, S]` (over `draft_vocab`, None: the whole vocabulary) weighted by the sink, plus
    each key's weight on its value token (`values [1 or n, L]`)."""
    n = head_logprobs.shape[0]
    probs = head_logprobs.new_zeros(n, vocab_size)
    head = (head_logprobs + sink_logw[:, None]).exp()
    if draft_vocab is None:
        probs += head
    else:
        probs[:, draft_vocab.to(probs.device)] = head
    probs.scatter_add_(1, values.expand(n, -1).to(probs.device), key_logw.exp().nan_to_num(0.0))
    return probs.clamp(min=1e-30).log()


def mixture_top_k(
    head_logprobs: torch.Tensor,
    draft_vocab: torch.Tensor | None,
    draft_index: torch.Tensor | None,
    sink_logw: torch.Tensor,
    key_logw: torch.Tensor,
    values: torch.Tensor,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k token ids and log-probabilities `[n, k]` of the mixture (`mixed_logprobs`) for rows that
    share one memory (`values [1, L]`, drafting), without building `[n, V]`. Exact: a token that neither
    the head ranks in its top-k nor any key points to has mixture probability sink * p_head <= that of
    each of the head's top-k, so the top-k lies among those candidates. `draft_index [V]`: token id ->
    index in the draft vocabulary, -1 outside it (None: the draft vocabulary is the whole vocabulary)."""
    n = head_logprobs.shape[0]
    copied, inverse = values[0].unique(return_inverse=True)  # [U] the tokens some key points to
    copy = head_logprobs.new_zeros(n, copied.numel()).scatter_add_(
        1, inverse[None].expand(n, -1), key_logw.exp().nan_to_num(0.0)
    )
    index = copied if draft_index is None else draft_index[copied]
    head_of_copied = head_logprobs.gather(1, index.clamp(min=0)[None].expand(n, -1))
    head_of_copied = head_of_copied.masked_fill((index < 0)[None], float("-inf"))
    mixed_copied = torch.logaddexp(head_of_copied + sink_logw[:, None], copy.clamp(min=1e-30).log())
    head_values, head_index = head_logprobs.topk(top_k, dim=-1)
    head_ids = head_index if draft_vocab is None else draft_vocab[head_index]
    head_values = (head_values + sink_logw[:, None]).masked_fill(torch.isin(head_ids, copied), float("-inf"))
    candidates = torch.cat([copied[None].expand(n, -1), head_ids], dim=1)
    values_k, pick = torch.cat([mixed_copied, head_values], dim=1).topk(top_k, dim=-1)
    return candidates.gather(1, pick), values_k


def target_logprob(
    head_logprobs: torch.Tensor,
    head_target: torch.Tensor,
    sink_logw: torch.Tensor,
    key_logw: torch.Tensor,
    values: torch.Tensor,
    target: torch.Tensor,
) -> torch.Tensor:
    """log p(target) under the mixture, `[n]`, without building `[n, V]` (training). `head_target [n]`:
    the target's index in the heads' vocabulary, negative when the head cannot draft it; -inf where
    neither the head nor the context has the target."""
    inside = head_target >= 0
    from_head = head_logprobs.gather(1, head_target.clamp(min=0)[:, None]).squeeze(1) + sink_logw
    from_head = torch.where(inside, from_head, torch.full_like(from_head, float("-inf")))
    match = values.expand_as(key_logw) == target[:, None]
    from_copy = key_logw.masked_fill(~match, float("-inf")).logsumexp(-1)
    return torch.logaddexp(from_head, from_copy)
