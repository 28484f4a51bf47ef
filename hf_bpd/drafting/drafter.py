"""`BlockDrafter`: what the user passes to `generate(..., assistant=drafter)`.

One drafting step: head logits -> top-k `Lattice` -> (optional rescorer: scored paths) -> `DraftTree` of at
most `max_tree_tokens` nodes. The rescorer only changes WHICH drafts are verified, never the output.
Heads that read the drafted token before their target ("previous" heads) grow the tree node by node
instead (`expansion.py`); their rescorers see the lattice of the heads' greedy chain. The trees are
assembled by the free functions of `assembly.py`; the drafter's files are `files.py`'s business, and its
binding to a base model (kernels, forward-cost curve) the decode side's (`decode/binding.py`).
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from ..cpu.streamed_linear import round_q8_0
from . import files
from .assembly import (
    BatchCost,
    CostCurve,
    add_rescored,
    best_path,
    fill_from_lattice,
    growth_budget,
    size_trees,
)
from .calibration import GREEDY, HEADS, SAMPLED, AcceptanceCalibration, Arc, SamplingWarp
from .context_vocab import ContextVocab, VocabExtension, context_vocab_refusal
from .corpus import CorpusIndex, corpus_source
from .eagle import EagleContext, EagleDraftLayer, grow_tree
from .expansion import GrownTree, chain_lattice, expand_tree, grow_on_device
from .heads import BlockDraftHeads
from .lattice import Lattice, ScoredPath
from .lookup import (
    lookup_continuation,
    lookup_source,
    lookup_tree,
    merge_chains,
    merge_lookup,
    merge_lookups_after_drafts,
)
from .tree import DraftTree

RECENT_STEPS = 16  # steps whose trees' kept grown nodes bound how far "previous" heads grow a tree that will be cut


@runtime_checkable
class Rescorer(Protocol):
    """Re-ranks a lattice's drafts. Called once per decoding step.

    `context` is the accepted sequence `[batch, length]`, ending with the root token (the last token the
    base model chose). Returns, per batch row, drafts (tokens after the root) best first; the drafter
    merges them into the tree in that order and fills what budget is left with the heads' own best
    prefixes. Stateful rescorers (their own KV cache) may use `reset()`, called at each new `generate`;
    `bind(model)`, if present, is called once per base model and raises when the rescorer does not fit it
    (another vocabulary or tokenizer).
    """

    def __call__(self, lattice: Lattice, context: torch.Tensor) -> list[list[ScoredPath]]: ...


LATTICE_FLOOR = -1e4  # log-probability of a lattice token sampling never draws (outside the nucleus)


@dataclass
class DraftingTimes:
    """Seconds a drafter spent drafting, by phase: what it books into its `stats` (a `generate` call
    replaces them with the call's `DecodingStats`, which has these fields too)."""

    time_heads: float = 0.0
    time_rescore: float = 0.0
    time_tree: float = 0.0


class BlockDrafter:
    """Drafts a tree per step from block draft heads, or from an EAGLE draft layer (`eagle.py`).

    heads:           the drafting module: `BlockDraftHeads`, or an `EagleDraftLayer`, which reads the features
                     of every accepted position (`reads_context`: the decoding loop hands them over with
                     `start_context` and `extend_context`) and grows its trees best-first (`eagle.grow_tree`).

    top_k:           tokens kept per head (lattice width), >= 1.
    max_tree_tokens: tokens verified per step, root included, >= 1 (1 = plain greedy decoding), or "auto":
                     measure the base model's forward-time curve on its device at first use and verify,
                     each step, the tree prefix with the most expected accepted tokens per second.
    forward_cost:    a `ForwardCost` curve to size trees by (instead of measuring it); with an integer
                     max_tree_tokens it sizes each step's tree up to that bound.
    rescorer:        optional `Rescorer`; None uses the heads' probabilities alone.
    calibrate:       learn from verification results how far to trust the acceptance estimates that order
                     and size trees (`AcceptanceCalibration`) and what a forward really costs in decoding
                     (`LearnedForwardCost`), kept across `generate` calls. Only matters where estimates
                     are used: "auto" trees or a rescorer with estimates.
    profile:         synchronise the device around each phase so `stats` times are exact (CPU: free).
    context_lookup:  longest chain (tokens) drafted by looking the context's last n-gram up in the context
                     (`lookup.py`: prompt-lookup's long copies inside the tree, competing with the heads'
                     nodes on calibrated probability, or on raw probability with calibrate=False);
                     0 turns it off.
    context_lookup_nodes: None: the chain after the context n-gram's most recent occurrence (the one that
                     has `context_lookup` tokens after it); an integer: the tree of what followed every
                     occurrence, up to that many nodes, each path estimated by how many occurrences it
                     continues (`lookup.lookup_tree`). The captured step refuses it (one chain).
    lookup_after_drafts: the most probable drafted nodes (0: none) below which the chain looked up with the
                     node's path appended to the context is merged too (`lookup.merge_lookups_after_drafts`);
                     the captured step refuses it.
    corpus:          optional `CorpusIndex` of the base model's own answers (`corpus.py`), or the path of
                     one its `save` wrote: the `corpus_nodes` most frequent nodes of what followed the
                     context's last tokens there (up to `context_lookup` tokens deep, 10 where that is
                     off), merged as the context's chain is.
    packed_linear:   run the whole decode (prefill, heads, tree forwards) with oneDNN pre-packed linear
                     weights (`packed_linear.py`: the kernels `hf_bpd.fast_cpu` gives plain `generate`;
                     one packed copy of the model's linear weights, shared with `fast_cpu`). None
                     ("auto"): on for float32 CPU models up to 2 GiB where the torch build has oneDNN,
                     off where `model.forward` is compiled (`torch.compile`): the tree forwards then run
                     through that compiled forward, the kernels compiled plain `generate` gets.
    compact_weights: round the drafting module's own linear weights to GGUF Q8_0's values, in place, once:
                     the CPU's streamed kernel then reads them as int8 copies, a quarter of the bytes
                     (`streamed_linear.round_q8_0`). Drafts change slightly; outputs never (they are
                     verified). The LM-head rows it borrows are the base model's and stay as they are.
    fallback:        an EAGLE layer's drafter only: a `BlockDrafter` of draft heads that decodes the calls the
                     layer does not serve (a batch, a model with recurrent state, the captured step; a layer
                     reading feature layers: a static cache or compiled forward), which are refused without
                     one (`decode/support.serving_drafter`). The call's stats are then its, copied here.
                     It keeps its own settings (its `drafter.json` in the saved folder's `fallback/`):
                     `from_pretrained`'s keyword arguments set the layer's.
    context_vocab:   the drafting module may also draft the context's tokens (the prompt's and the answer's so
                     far) outside its draft vocabulary, scored by the base model's LM-head rows in the same
                     softmax (`context_vocab.py`): an EAGLE layer, or "previous" heads tied to that LM head
                     without a context copy. Heads draft with the tokens of the context as their last drafted
                     step saw it (the first: the prompt's), which is what a tree grown inside the step before
                     can know. Off by default; the captured step refuses it.

    What the decoding loops (`hf_bpd/decode/`) use, and nothing else:
    - `draft(...)`: one step's trees (`step_cost`: the cost to size one row's trees by, `batch_cost` a
      batch's); `root_trees(roots)` for a plain step; `cut(trees, limit)` for a step's node limit;
      `chains(trees, room)` for models verified one chain at a time;
    - `grow(...)` and `grows_on_device`: the next tree grown on the device inside a fused accept;
    - `log_scales()`: the calibration's depth weights of the heads' arcs, which `grow` searches with (the
      captured step, `decode/captured.py`, reads the `calibration`'s sums instead and learns on the device);
    - `observe(accepted_nodes, finished)`: the verification fed back to the calibration;
    - settings and state they read: `tree_budget`, `max_tree_tokens`, `forward_cost` (which the binding
      measures into), `rescorer`, `packed_linear`, `profile`, `fused_sampling`, `count_host_syncs`, `heads`,
      `calibration`, `top_k`, `context_lookup`, the captured step's optional `captured_topology` and
      `captured_sizes`, and `stats` (the call's `DecodingStats`, set with `heads_context`, the kernels the heads
      run in, where the drafter is bound to a model: `hf_bpd.prepare`); `exclusive()`, held while decoding.
    """

    def __init__(
        self,
        heads: BlockDraftHeads,
        top_k: int = 10,
        max_tree_tokens: int | str = 32,
        rescorer: Rescorer | None = None,
        profile: bool = False,
        forward_cost: CostCurve | None = None,
        calibrate: bool = True,
        packed_linear: bool | None = None,
        context_lookup: int = 10,
        context_lookup_nodes: int | None = None,
        lookup_after_drafts: int = 0,
        corpus: CorpusIndex | str | Path | None = None,
        corpus_nodes: int = 10,
        compact_weights: bool = False,
        fallback: BlockDrafter | None = None,
        context_vocab: bool = False,
    ) -> None:
        if not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"top_k must be an integer >= 1, got {top_k!r}")
        draft_vocab = heads.config.draft_vocab_size or heads.config.vocab_size
        if top_k > draft_vocab:
            raise ValueError(f"top_k={top_k} exceeds the heads' draft vocabulary of {draft_vocab} tokens")
        if max_tree_tokens != "auto" and (not isinstance(max_tree_tokens, int) or max_tree_tokens < 1):
            raise ValueError(f"max_tree_tokens must be an integer >= 1 or 'auto', got {max_tree_tokens!r}")
        if not isinstance(context_lookup, int) or context_lookup < 0:
            raise ValueError(f"context_lookup must be an integer >= 0 (0: off), got {context_lookup!r}")
        if context_lookup_nodes is not None and (not isinstance(context_lookup_nodes, int) or context_lookup_nodes < 1):
            raise ValueError(f"context_lookup_nodes must be None or an integer >= 1, got {context_lookup_nodes!r}")
        if not isinstance(lookup_after_drafts, int) or lookup_after_drafts < 0:
            raise ValueError(f"lookup_after_drafts must be an integer >= 0 (0: off), got {lookup_after_drafts!r}")
        if not isinstance(corpus_nodes, int) or corpus_nodes < 1:
            raise ValueError(f"corpus_nodes must be an integer >= 1, got {corpus_nodes!r}")
        if packed_linear not in (None, True, False):
            raise ValueError(f"packed_linear must be True, False or None (auto), got {packed_linear!r}")
        if compact_weights not in (True, False):
            raise ValueError(f"compact_weights must be True or False, got {compact_weights!r}")
        if context_vocab not in (True, False):
            raise ValueError(f"context_vocab must be True or False, got {context_vocab!r}")
        if context_vocab and (why := context_vocab_refusal(heads.config.to_dict())):
            raise ValueError(f"context_vocab: {why}")
        if rescorer is not None and isinstance(heads, EagleDraftLayer):
            raise ValueError("a rescorer re-ranks the heads' lattice, and an EAGLE draft layer has none: rescorer=None")
        if rescorer is not None and not isinstance(rescorer, Rescorer):
            raise TypeError(f"rescorer must be callable as rescorer(lattice, context), got {type(rescorer).__name__}")
        if fallback is not None:
            if not isinstance(fallback, BlockDrafter):
                raise TypeError(f"fallback must be a BlockDrafter of draft heads, got {type(fallback).__name__}")
            if not isinstance(heads, EagleDraftLayer):
                raise ValueError("fallback serves the calls an EAGLE draft layer does not; draft heads serve them all")
            if fallback.reads_context:
                raise ValueError("fallback must draft with draft heads, which serve every call: got an EAGLE layer")
        self.fallback = fallback
        self.heads = heads
        self.compact_weights = compact_weights
        self.context_vocab = context_vocab
        if compact_weights:
            round_linear_weights(heads)
        self.top_k = top_k
        self.max_tree_tokens = max_tree_tokens
        self.rescorer = rescorer
        self.profile = profile
        self.forward_cost = forward_cost
        self.packed_linear = packed_linear
        self.context_lookup = context_lookup
        self.context_lookup_nodes = context_lookup_nodes
        self.lookup_after_drafts = lookup_after_drafts
        if isinstance(corpus, (str, Path)):
            corpus = CorpusIndex.load(corpus)
        elif corpus is not None and not isinstance(corpus, CorpusIndex):
            raise TypeError(f"corpus must be a CorpusIndex or the path of a saved one, got {type(corpus).__name__}")
        self.corpus = corpus
        self.corpus_nodes = corpus_nodes
        # the context the heads run in (oneDNN packed weights or none): set where the drafter is bound to a
        # model (`decode/binding.py`)
        self.heads_context: contextlib.AbstractContextManager = contextlib.nullcontext()
        self.calibration = AcceptanceCalibration() if calibrate else None
        self._verified: list[tuple[DraftTree, list[Arc]] | None] = []  # per row: the last tree and its arcs
        self.stats = DraftingTimes()  # a `generate` call's `DecodingStats` once bound
        # count device-to-host synchronisations by phase into stats.host_syncs (a test's or measurement's
        # setting: counting costs a Python call per torch call, so a timed run leaves it off)
        self.count_host_syncs = False
        # sampled steps walk the tree on the device with one copy per step (`sampled_walk.py`): None ("auto")
        # on accelerators only, where each read stalls the device; on a CPU reading a token costs nothing
        # and the host walk makes fewer draws. True or False forces it (a test's or measurement's setting)
        self.fused_sampling: bool | None = None
        self._recent_grown: deque[int] = deque(maxlen=RECENT_STEPS)  # grown nodes the last sized trees kept
        # an EAGLE layer's context: its KV cache, and the accepted positions' features not yet run through it
        self._context = EagleContext(context_vocab=self.context_vocab)
        self._pending: list[tuple[torch.Tensor, list[int]]] = []
        # heads' context_vocab: the context's tokens outside the draft vocabulary, and how many positions of
        # the context they were gathered from (`start_call` empties them)
        self._heads_vocab = ContextVocab()
        self._heads_vocab_positions = 0
        self._in_use = threading.Lock()

    @classmethod
    def from_pretrained(cls, path: str | Path, base_tokenizer=None, **kwargs) -> BlockDrafter:
        """The drafter saved with `save_pretrained` (a folder or Hub repo id): its heads, with the settings
        of its `drafter.json` (and rescorer) where it has one; keyword arguments override them. Plain heads
        folders (no `drafter.json`) load with the default settings."""
        return files.load_drafter(cls, path, base_tokenizer, **kwargs)

    def settings(self) -> dict:
        """What `drafter.json` records: every constructor setting that travels with the heads (the
        rescorer as its spec; a forward-cost curve is measured on each machine instead)."""
        return files.drafter_settings(self)

    def save_pretrained(self, path: str | Path, repo_id: str = "<repo_id>", **card_kwargs) -> Path:
        """A folder that loads itself: the heads (weights, config), `drafter.json` (these settings and the
        rescorer's spec and files), a model card (`card_kwargs`: see `hf_bpd.card.render_card`) and a
        `custom_generate/` folder, so `model.generate(..., custom_generate=<folder or repo>,
        trust_remote_code=True)` drafts with exactly this drafter, no `assistant` needed."""
        return files.save_drafter(self, path, repo_id, **card_kwargs)

    def push_to_hub(
        self,
        repo_id: str,
        private: bool | None = None,
        token: str | None = None,
        commit_message: str = "Upload hf_bpd drafter",
        **card_kwargs,
    ) -> str:
        """Upload exactly the folder `save_pretrained` writes."""
        return files.push_drafter(self, repo_id, private, token, commit_message, **card_kwargs)

    @property
    def num_heads(self) -> int:
        return self.heads.num_heads

    @property
    def reads_context(self) -> bool:
        """Whether the drafter reads the features of every accepted position (an EAGLE draft layer), which the
        loop hands over: the prompt's with `start_context`, each step's accepted nodes' with
        `extend_context`."""
        return isinstance(self.heads, EagleDraftLayer)

    def start_context(self, features: torch.Tensor, next_tokens: Sequence[int]) -> None:
        """A new sequence's context: the base model's final hidden states of its prompt `[P, H]` and the token
        after each position (the prompt's own, then the first new token). Nothing for heads. The prompt's rows
        run through the layer now, beside the prefill: run at the first draft, their cost would be that step's,
        and the step chooser, judging drafting by it, would take plain steps for a while."""
        self._context = EagleContext(context_vocab=self.context_vocab)
        self._pending = []
        self.extend_context(features, next_tokens)
        if self.reads_context:
            with self.heads_context:
                self._run_pending()

    def extend_context(self, features: torch.Tensor, next_tokens: Sequence[int]) -> None:
        """The accepted positions' features `[n, H]` (a step's accepted nodes, root first) and the token after
        each (the step's new tokens), run through the layer at the next draft. Nothing for heads."""
        if not self.reads_context:
            return
        if features.dim() != 2 or features.shape[0] != len(next_tokens):
            raise ValueError(
                f"extend_context needs features [n, hidden] and n next tokens, got {tuple(features.shape)} and "
                f"{len(next_tokens)}"
            )
        self._pending.append((features, list(next_tokens)))

    def catch_up_context(self) -> None:
        """Run the rows handed over so far now, for a drafted step that follows plain ones, before its clock
        starts (the loop calls it). Those are rows the plain steps left for the layer: run inside the probe
        that ends a plain run, their cost, growing with the run, made each probe look slower than drafting
        is, and the step chooser kept a call plain to its end. Their time is the drafter's
        (`stats.time_heads`), not the step's. Nothing for heads."""
        if self.reads_context and self._pending:
            t0 = time.perf_counter()
            with self.heads_context:
                self._run_pending()
            device = self.heads.device
            if device.type == "cuda":  # else the step's first read of the layer's output would wait for them
                torch.cuda.synchronize(device)
            self.stats.time_heads += time.perf_counter() - t0

    def _run_pending(self) -> None:
        """Run the rows handed over since the last draft through the layer, in one call."""
        if self._pending:
            features = torch.cat([f for f, _ in self._pending]).to(self.heads.device, self.heads.dtype)
            tokens = torch.tensor([t for _, ts in self._pending for t in ts], device=self.heads.device)
            self._pending = []
            self._context.extend(self.heads, features, tokens)

    def _context_prediction(self, context_length: int) -> EagleContext:
        """The layer's context with every pending row run, checked to cover a context of `context_length`
        tokens (one row per position but the last, the root): a loop that skipped a step's features would
        otherwise draft from a wrong context without a word."""
        self._run_pending()
        if self._context.rows != context_length - 1:
            raise RuntimeError(
                f"the EAGLE layer holds {self._context.rows} context rows for a context of {context_length} tokens: "
                "the decoding loop must hand every accepted position's features over (start_context, extend_context)"
            )
        return self._context

    @contextlib.contextmanager
    def exclusive(self):
        """Held by `generate` while it decodes: a drafter's stats, calibration and rescorer caches belong to
        one generation at a time, so a second concurrent one (another thread) is refused, never mixed in."""
        if not self._in_use.acquire(blocking=False):
            raise RuntimeError(
                "this BlockDrafter is already decoding another generation (another thread?): give each thread "
                "its own drafter; drafter.with_rescorer(drafter.rescorer) copies it, sharing the heads' weights"
            )
        try:
            yield self
        finally:
            self._in_use.release()

    def _sync(self, device: torch.device) -> float:
        if self.profile and device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    def lattice(
        self,
        hidden_last: torch.Tensor,
        root: torch.Tensor,
        context: torch.Tensor | None = None,
        warp: SamplingWarp | None = None,
    ) -> Lattice:
        """Head logits on the last accepted hidden state `[batch, hidden]` -> top-k lattice. `root [batch]`:
        the base model's token from that state (the tree root; heads with a token input read it). For
        "previous" heads: the lattice of their greedy chain (`expansion.chain_lattice`), where
        context-copy heads point into `context [batch, L]` (the accepted tokens, ending with the root).
        `warp`: a sampled call's, applied to a lattice the tree is drafted from (not to a chain lattice,
        which only feeds a rescorer)."""
        with torch.no_grad():
            if self.heads.conditions_on_draft:
                return chain_lattice(
                    self.heads, hidden_last.to(self.heads.device, self.heads.dtype), root, self.top_k, context
                )
            logits = self.heads(hidden_last.to(self.heads.device, self.heads.dtype), root)
            ids = self.heads.draft_vocab if self.heads.config.draft_vocab_size else None
            lattice = Lattice.from_logits(logits, self.top_k, ids)
            if warp is not None:  # a finite floor outside the nucleus: k-best searches subtract scores
                warped = warp(lattice.logprobs.flatten(0, 1)).clamp_min(LATTICE_FLOOR)
                lattice = Lattice(lattice.tokens, warped.view_as(lattice.logprobs))
            return lattice

    @property
    def tree_budget(self) -> int:
        """Most tree tokens a step may verify."""
        if self.max_tree_tokens == "auto":
            return self.forward_cost.max_size if self.forward_cost is not None else 64
        return self.max_tree_tokens

    def with_rescorer(self, rescorer: Rescorer | None) -> BlockDrafter:
        """A drafter with these heads and settings (and forward-cost curve) and another rescorer; an EAGLE
        layer's fallback heads are copied the same way (their own calibration, lock and binding)."""
        return BlockDrafter(
            self.heads,
            self.top_k,
            self.max_tree_tokens,
            rescorer,
            self.profile,
            self.forward_cost,
            calibrate=self.calibration is not None,
            packed_linear=self.packed_linear,
            context_lookup=self.context_lookup,
            context_lookup_nodes=self.context_lookup_nodes,
            lookup_after_drafts=self.lookup_after_drafts,
            corpus=self.corpus,
            corpus_nodes=self.corpus_nodes,
            fallback=None if self.fallback is None else self.fallback.with_rescorer(self.fallback.rescorer),
            context_vocab=self.context_vocab,
        )

    def root_trees(self, roots: list[int]) -> list[DraftTree]:
        """A plain step's trees: the roots alone (nothing drafted, nothing for `observe` to learn)."""
        self._verified = [None] * len(roots)
        return [DraftTree.root_only(root) for root in roots]

    def chains(self, trees: Sequence[DraftTree], room: Sequence[int]) -> list[DraftTree]:
        """Each tree reduced to one root-to-leaf path of at most `room[b]` nodes, for models verified one chain
        at a time (`recurrent.py`): where the tree's arcs are known, the path with the most expected accepted
        tokens (the sum of its nodes' path probabilities), else each node's first child (trees add children
        best first; a rescorer's drafts come first, as they are verified first in a tree, so its trees take
        that path too). `observe` then learns from that chain alone, its siblings never having been verified."""
        out = []
        for b, tree in enumerate(trees):
            known = self._verified[b] if b < len(self._verified) else None
            scored = known is not None and self.rescorer is None
            path = best_path(tree, tree.path_logprobs(known[1], self.calibration) if scored else None)
            path = path[: room[b]]
            chain = tree.reordered(path)
            out.append(chain)
            if known is not None:
                self._verified[b] = (chain, [known[1][i] for i in path])
        return out

    def rescore(self, lattice: Lattice | None, context: torch.Tensor) -> list[list[ScoredPath]] | None:
        """The rescorer's drafts per batch row (None without a rescorer or room for drafts)."""
        if self.rescorer is None or lattice is None or self.tree_budget <= 1:
            return None
        return self.rescorer(lattice, context)

    def tree(
        self,
        lattice: Lattice | None,
        context: torch.Tensor,
        max_depth: int | None = None,
        rescored: list[list[ScoredPath]] | None = None,
        hidden_last: torch.Tensor | None = None,
        max_tokens: int | None = None,
        batch_cost: BatchCost | None = None,
        warp: SamplingWarp | None = None,
        host_context: Sequence[Sequence[int]] | None = None,
        grown: Sequence[tuple[DraftTree, list[Arc]]] | None = None,
        step_cost: CostCurve | None = None,
    ) -> list[DraftTree]:
        """One draft tree per batch row: the most probable nodes among the heads' best prefixes and the
        `rescored` drafts (drafts without estimates first); with a forward-cost curve, cut to the prefix
        with the best expected tokens per second (by `step_cost`: see `draft`).
        Probabilities are calibrated (`calibration`). "Previous" heads grow each tree from `hidden_last
        [batch, hidden]` (`expansion.expand_tree`) instead and need no `lattice`. `max_tokens` caps the tree
        below the drafter's own budget (an attention window). `batch_cost`: a batch verifies these trees
        padded to one width, with `batch_cost.rows` rows (finished rows included), so one width is chosen for
        all of them by that cost (`assembly.best_batch_width`). `warp`: a sampled call's, for the heads'
        children that "previous" heads grow (see `draft`). `host_context`: the rows of `context` as host
        lists, where the caller keeps them: the root and the context lookup then read them instead of
        copying from the device. `grown`: per row, the tree "previous" heads already grew for this step
        (`grow`, read by the host) and its arcs."""
        if self.heads.conditions_on_draft and hidden_last is None and grown is None:
            raise ValueError("heads that read the drafted token grow trees from the hidden state: pass hidden_last")
        if self.reads_context and context.shape[0] != 1:
            raise ValueError("an EAGLE draft layer drafts one row at a time")
        if lattice is None and not self.heads.conditions_on_draft and not self.reads_context:
            raise ValueError("these heads draft from their lattice: pass it")
        budget = self.tree_budget if max_tokens is None else max(1, min(self.tree_budget, max_tokens))
        sized = self.forward_cost is not None
        growth = growth_budget(budget, self._recent_grown, sized, 8 if batch_cost is None else 2)
        roots = context[:, -1].tolist() if host_context is None else [row[-1] for row in host_context]  # one copy
        if self.context_vocab and self._heads_vocab_positions == 0:  # the call's first drafted step: the prompt
            self._gather_heads_vocab(context, host_context)
        if self.heads.conditions_on_draft and grown is None and self.grows_on_device and not rescored:
            # every row's tree grown in one call and read in one copy: a batch reads the heads' and the
            # softmax layer's weights once per round, not once per row
            t0 = time.perf_counter()
            grown_trees = self.grow(hidden_last, context[:, -1], growth, max_depth, warp)  # moves hidden_last itself
            grown = GrownTree.rows_on_host(roots, grown_trees.flat().tolist())
            self.stats.time_heads += time.perf_counter() - t0  # the copy waited for the growth
        trees, node_arcs = [], []
        self._verified = []
        for b, root in enumerate(roots):
            row = None if host_context is None else host_context[b]
            tree = DraftTree.root_only(root)
            # Rescored drafts with per-token acceptance estimates compete with the heads' prefixes on
            # estimated probability (a node's arc: the higher of the two estimates); drafts without
            # estimates are verified first, as given.
            estimates = add_rescored(tree, rescored[b] if rescored is not None else [], budget, max_depth)
            given_first = len(tree) > 1  # a rescorer's drafts without estimates, verified first as given
            if self.heads.conditions_on_draft and grown is not None:
                tree, arcs = grown[b]  # grown on the device during the last step, read with its tokens
            elif self.reads_context:
                t0 = time.perf_counter()
                with self.heads_context:
                    layer_context = self._context_prediction(context.shape[1])
                    tree, arcs = grow_tree(
                        self.heads, layer_context, root, self.top_k, growth, max_depth, self.calibration
                    )
                self.stats.time_heads += time.perf_counter() - t0
            elif self.heads.conditions_on_draft:
                t0 = time.perf_counter()
                hidden = hidden_last[b : b + 1].to(self.heads.device, self.heads.dtype)
                arcs = expand_tree(
                    tree,
                    self.heads,
                    hidden,
                    self.top_k,
                    growth,
                    max_depth,
                    estimates,
                    self.calibration,
                    context[b],
                    warp,
                    before_root=None if row is None or len(row) < 2 else row[-2],
                    extension=self.heads_vocab_extension,
                )
                self.stats.time_heads += time.perf_counter() - t0  # its rounds read their children on the host
            else:
                arcs = fill_from_lattice(
                    tree, lattice, b, budget, max_depth, estimates, self.calibration, sized, self.drafts_chains
                )
            if arcs is not None and not given_first:  # grown in rounds: prefixes must be the best subtrees
                tree, arcs = tree.by_path_probability(arcs, self.calibration)
            if self.drafts_chains and arcs is not None:
                longest = self.context_lookup or 10
                limit = longest if max_depth is None else min(longest, max_depth)
                tokens = context[b].cpu().numpy() if row is None else np.asarray(row)
                if self.context_lookup and self.context_lookup_nodes:
                    chains, ngram = lookup_tree(tokens, limit, self.context_lookup_nodes)
                    tree, arcs = merge_chains(tree, arcs, chains, lookup_source(ngram), self.calibration, budget)
                elif self.context_lookup:
                    chain, ngram = lookup_continuation(tokens, limit)
                    tree, arcs = merge_lookup(tree, arcs, chain, ngram, self.calibration, budget)
                if self.context_lookup and self.lookup_after_drafts:
                    tree, arcs = merge_lookups_after_drafts(
                        tree, arcs, tokens, self.lookup_after_drafts, limit, self.calibration, budget
                    )
                if self.corpus is not None:
                    chains, ngram = self.corpus.continuations(tokens, limit, self.corpus_nodes)
                    tree, arcs = merge_chains(tree, arcs, chains, corpus_source(ngram), self.calibration, budget)
            trees.append(tree)
            node_arcs.append(arcs)
        if sized:
            cost = self.forward_cost if step_cost is None else step_cost
            trees, kept_grown = size_trees(trees, node_arcs, self.calibration, cost, batch_cost)
            self._recent_grown.extend(kept_grown)
        for tree, arcs in zip(trees, node_arcs):
            known = arcs is not None and self.calibration is not None
            self._verified.append((tree, arcs[: len(tree)]) if known else None)  # a prefix keeps node indices
        if self.context_vocab:
            self._gather_heads_vocab(context, host_context)  # for the next step's tree
        return trees

    @property
    def heads_vocab_extension(self) -> VocabExtension | None:
        """The context tokens outside the draft vocabulary that heads with `context_vocab` may draft: those of
        the context as the last drafted step saw it."""
        return self._heads_vocab.extension

    def _gather_heads_vocab(self, context: torch.Tensor, host_context: Sequence[Sequence[int]] | None) -> None:
        """Add the context's positions not gathered yet (every row's) to heads' `context_vocab`."""
        start = self._heads_vocab_positions
        if self.reads_context or context.shape[1] <= start:  # a layer gathers its own (`EagleContext`)
            return
        rows = [row[start:] for row in host_context] if host_context is not None else context[:, start:].tolist()
        self._heads_vocab.add(self.heads, [t for row in rows for t in row])
        self._heads_vocab_positions = context.shape[1]

    def start_call(self) -> None:
        """Empty the state one `generate` call gathers and the next must not inherit (heads' `context_vocab`);
        `binding.prepare` calls it."""
        self._heads_vocab = ContextVocab()
        self._heads_vocab_positions = 0

    def cut(self, trees: Sequence[DraftTree], limit: int | None) -> list[DraftTree]:
        """`trees` cut to at most `limit` nodes each (None: as they are), with what `observe` will score cut
        alike: a tree grown a step ahead (`grow`) was grown before its step's limit was known."""
        if limit is None or all(len(tree) <= limit for tree in trees):
            return list(trees)
        for b, verified in enumerate(self._verified):
            if verified is not None and len(verified[0]) > limit:
                self._verified[b] = (verified[0].truncated(limit), verified[1][:limit])
        return [tree.truncated(limit) if len(tree) > limit else tree for tree in trees]

    def expected_tokens(self) -> float | None:
        """The tokens the trees about to be verified are expected to add, summed over their rows: each node's
        calibrated path probability, the root's 1 included (the expectation their sizes were chosen by:
        `assembly.size_trees`). None where a row's arcs are unknown (no calibration, or a plain step's roots).
        Read before the verification is observed, so that its outcome is not in it."""
        if not self._verified or any(known is None for known in self._verified):
            return None
        return sum(math.exp(lp) for tree, arcs in self._verified for lp in tree.path_logprobs(arcs, self.calibration))

    @property
    def drafts_chains(self) -> bool:
        """Whether trees merge a looked-up chain (the context's or the corpus'), which competes with the heads'
        nodes on their arcs."""
        return self.context_lookup > 0 or self.corpus is not None

    @property
    def grows_on_device(self) -> bool:
        """Whether "previous" heads grow their trees on the device (`expansion.grow_on_device`: one copy to
        the host per tree): without a rescorer (whose drafts join the search) or a context-copy pointer."""
        return self.heads.conditions_on_draft and self.rescorer is None and self.heads.context_copy is None

    def grow(
        self,
        hidden: torch.Tensor,
        root: torch.Tensor,
        budget: int | None = None,
        max_depth: int | None = None,
        warp: SamplingWarp | None = None,
    ) -> GrownTree:
        """The tree "previous" heads grow from `hidden [1, H]` and `root [1]` (device tensors), on the device
        (`grows_on_device`), not read yet. `budget`: nodes to grow (default: this step's growth budget)."""
        if budget is None:
            budget = growth_budget(self.tree_budget, self._recent_grown, self.forward_cost is not None)
        log_scales = self.log_scales(sampled=warp is not None)
        with self.heads_context:
            hidden = hidden.to(self.heads.device, self.heads.dtype)
            extension = self.heads_vocab_extension
            return grow_on_device(self.heads, hidden, root, self.top_k, budget, log_scales, warp, max_depth, extension)

    def log_scales(self, sampled: bool = False) -> list[float]:
        """The calibration's log multiplier of the heads' arcs at each depth (index 0 unused; all 0 without a
        calibration), for greedy or sampled decoding: how `grow_on_device` weighs each depth's
        probabilities."""
        scales = [0.0] * (self.heads.num_heads + 1)
        if self.calibration is not None:
            self.calibration.regime = SAMPLED if sampled else GREEDY
            scales[1:] = [math.log(self.calibration.scale(HEADS, d)) for d in range(1, len(scales))]
        return scales

    def observe(self, accepted_nodes: list[list[int]], finished: list[bool]) -> None:
        """Feed back one verification step: per row, the tree nodes the base model accepted (root first)
        and whether decoding stopped at the last of them (then its children were never compared). Updates
        the calibration with every drafted child of a reached node. (The forward's time corrects the
        forward cost on the decode side: `ModelBinding.observe_forward`.)"""
        if self.calibration is None:
            return
        for verified, nodes, stopped in zip(self._verified, accepted_nodes, finished):
            if verified is None:
                continue
            tree, arcs = verified
            reached, accepted = set(nodes[:-1] if stopped else nodes), set(nodes)
            for i in range(1, len(tree)):
                if tree.parents[i] in reached:
                    self.calibration.observe(arcs[i], tree.depths[i], i in accepted)

    def draft(
        self,
        hidden_last: torch.Tensor,
        context: torch.Tensor,
        max_depth: int | None = None,
        max_tokens: int | None = None,
        batch_cost: BatchCost | None = None,
        warp: SamplingWarp | None = None,
        host_context: Sequence[Sequence[int]] | None = None,
        grown: Sequence[tuple[DraftTree, list[Arc]]] | None = None,
        step_cost: CostCurve | None = None,
    ) -> Sequence[DraftTree]:
        """Heads -> lattice -> trees (at most `max_tokens` nodes each, when given; `batch_cost`: see
        `tree`), timing each phase into `stats`. `warp`: the sampled call's (`SamplingWarp.from_config`;
        None when greedy): the heads' estimates are warped like the base model's draws, and calibrated
        in the sampled regime. `host_context`, `grown`: see `tree`. `step_cost`: what a verification forward
        of n tokens costs, to size one row's tree by where the drafter has a `forward_cost` (the call's
        curve corrected by the forwards it timed, `decode.binding.ModelBinding.step_cost`; default: the
        curve itself)."""
        t0 = self._sync(hidden_last.device)
        if self.calibration is not None:
            self.calibration.regime = GREEDY if warp is None else SAMPLED
        # "previous" heads draft the tree node by node; their chain lattice only serves a rescorer
        needs_lattice = self.rescorer is not None or not self.heads.conditions_on_draft
        needs_lattice = needs_lattice and grown is None and not self.reads_context
        lattice_warp = None if self.heads.conditions_on_draft else warp
        with self.heads_context:
            lattice = self.lattice(hidden_last, context[:, -1], context, lattice_warp) if needs_lattice else None
        t1 = self._sync(hidden_last.device)
        rescored = self.rescore(lattice, context)
        heads_before = self.stats.time_heads
        t2 = time.perf_counter()
        with self.heads_context:
            trees = self.tree(
                lattice,
                context,
                max_depth,
                rescored,
                hidden_last,
                max_tokens,
                batch_cost,
                warp,
                host_context,
                grown,
                step_cost,
            )
        t3 = time.perf_counter()
        # "previous" heads grow the tree inside `tree`, which books that as heads time (as a fused greedy
        # step's accept does, `row.accept_greedy_and_grow`): the tree phase is the rest
        self.stats.time_tree += t3 - t2 - (self.stats.time_heads - heads_before)
        self.stats.time_heads += t1 - t0
        self.stats.time_rescore += t2 - t1
        return trees


@torch.no_grad()
def round_linear_weights(module: torch.nn.Module) -> None:
    """Round every linear layer's weight in `module` to Q8_0's values in place (`compact_weights`); a
    weight whose rows are no whole blocks of 32 stays as it is."""
    for layer in module.modules():
        if isinstance(layer, torch.nn.Linear) and layer.in_features % 32 == 0:
            layer.weight.copy_(round_q8_0(layer.weight))
