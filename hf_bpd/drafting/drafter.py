"""`BlockDrafter`: what the user passes to `generate(..., assistant=drafter)`.

One drafting step: head logits -> top-k `Lattice` -> (optional rescorer: scored paths) -> `DraftTree` of at
most `max_tree_tokens` nodes. The rescorer only changes WHICH drafts are verified, never the output.
Heads that read the drafted token before their target ("previous" heads) grow the tree node by node
instead (`expansion.py`); their rescorers see the lattice of the heads' greedy chain.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from ..compat import compiled_forward
from ..cpu.packed_linear import KernelPlan, PackedLinear, cached_kernel_plan, linear_context, wants_packed_linear
from ..decode.cost import (
    BatchForwardCost,
    ForwardCost,
    LearnedForwardCost,
    StepChooser,
    best_batch_width,
    best_tree_size,
    cached_forward_cost,
)
from ..decode.stats import DecodingStats
from ..disk_cache import forget
from ..log import logger
from .calibration import GREEDY, HEADS, SAMPLED, AcceptanceCalibration, Arc, SamplingWarp
from .expansion import GrownTree, chain_lattice, expand_tree, grow_on_device
from .heads import BlockDraftHeads
from .lattice import Lattice, ScoredPath
from .lookup import lookup_continuation, merge_lookup
from .tree import DraftTree

# a measured forward-cost curve this far off the forwards decoding timed is measured again
# (`review_forward_cost`): well above what a longer context than the measurement's adds
CONTRADICTED = 2.0
RECENT_STEPS = 16  # steps whose tree sizes bound how far "previous" heads grow a tree that will be cut


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


class BlockDrafter:
    """Drafts a tree per step from block draft heads.

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
                     nodes on calibrated probability); 0 turns it off. Used where trees are ordered by
                     estimates (the heads' arcs are known: "auto" trees, or calibrate=True).
    packed_linear:   run the whole decode (prefill, heads, tree forwards) with oneDNN pre-packed linear
                     weights (`packed_linear.py`: the kernels `hf_bpd.fast_cpu` gives plain `generate`;
                     one packed copy of the model's linear weights, shared with `fast_cpu`). None
                     ("auto"): on for float32 CPU models up to 2 GiB where the torch build has oneDNN,
                     off where `model.forward` is compiled (`torch.compile`): the tree forwards then run
                     through that compiled forward, the kernels compiled plain `generate` gets.
    """

    def __init__(
        self,
        heads: BlockDraftHeads,
        top_k: int = 10,
        max_tree_tokens: int | str = 32,
        rescorer: Rescorer | None = None,
        profile: bool = False,
        forward_cost: ForwardCost | None = None,
        calibrate: bool = True,
        packed_linear: bool | None = None,
        context_lookup: int = 10,
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
        if packed_linear not in (None, True, False):
            raise ValueError(f"packed_linear must be True, False or None (auto), got {packed_linear!r}")
        if rescorer is not None and not isinstance(rescorer, Rescorer):
            raise TypeError(f"rescorer must be callable as rescorer(lattice, context), got {type(rescorer).__name__}")
        self.heads = heads
        self.top_k = top_k
        self.max_tree_tokens = max_tree_tokens
        self.rescorer = rescorer
        self.profile = profile
        self.forward_cost = forward_cost
        self.packed_linear = packed_linear
        self.context_lookup = context_lookup
        # the contexts the decode and the heads run in (oneDNN packed weights or none): set by `prepare`
        self.linear_context: contextlib.AbstractContextManager = contextlib.nullcontext()
        self._heads_context: contextlib.AbstractContextManager = contextlib.nullcontext()
        self.calibration = AcceptanceCalibration() if calibrate else None
        self._verified: list[tuple[DraftTree, list[Arc]] | None] = []  # per row: the last tree and its arcs
        self._learned_cost: LearnedForwardCost | None = None
        self.stats = DecodingStats()
        # count device-to-host synchronisations by phase into stats.host_syncs (a test's or measurement's
        # setting: counting costs a Python call per torch call, so a timed run leaves it off)
        self.count_host_syncs = False
        # sampled steps walk the tree on the device with one copy per step (`sampled_walk.py`): None ("auto")
        # on accelerators only, where each read stalls the device; on a CPU reading a token costs nothing
        # and the host walk makes fewer draws. True or False forces it (a test's or measurement's setting)
        self.fused_sampling: bool | None = None
        self._bound_to: tuple[int, bool] | None = None  # (id of the model, whether its forward was compiled)
        self._measured_cost = False  # forward_cost was measured by `prepare` (not given): re-measured on rebinding
        # decoding contradicted the measured curve: measure it at the next call; and whether that happened in this
        # binding (`review_forward_cost`)
        self._remeasure_cost = self._cost_remeasured = False
        self.setup: dict = {}  # one-time start-up work of the last `prepare` that did any (forward-cost curve)
        self._recent_sizes: deque[int] = deque(maxlen=RECENT_STEPS)  # sizes of the last sized trees
        self._in_use = threading.Lock()

    @classmethod
    def from_pretrained(cls, path: str | Path, base_tokenizer=None, **kwargs) -> BlockDrafter:
        """The drafter saved with `save_pretrained` (a folder or Hub repo id): its heads, with the settings
        of its `drafter.json` (and rescorer) where it has one; keyword arguments override them. Plain heads
        folders (no `drafter.json`) load with the default settings."""
        from .rescoring.composed import build_rescorer

        hub = {k: kwargs.pop(k) for k in ("revision", "token", "local_files_only") if k in kwargs}
        heads = BlockDraftHeads.from_pretrained(path, **hub)
        folder, settings = _drafter_settings(path, hub)
        spec = settings.pop("rescorer", None)
        if spec is not None and "rescorer" not in kwargs:
            kwargs["rescorer"] = build_rescorer(spec, folder, base_tokenizer)
        return cls(heads, **{**settings, **kwargs})

    def settings(self) -> dict:
        """What `drafter.json` records: every constructor setting that travels with the heads (the
        rescorer as its spec; a forward-cost curve is measured on each machine instead)."""
        return {
            "top_k": self.top_k,
            "max_tree_tokens": self.max_tree_tokens,
            "context_lookup": self.context_lookup,
            "calibrate": self.calibration is not None,
            "packed_linear": self.packed_linear,
        }

    def save_pretrained(self, path: str | Path, repo_id: str = "<repo_id>", **card_kwargs) -> Path:
        """A folder that loads itself: the heads (weights, config), `drafter.json` (these settings and the
        rescorer's spec and files), a model card (`card_kwargs`: see `hf_bpd.card.render_card`) and a
        `custom_generate/` folder, so `model.generate(..., custom_generate=<folder or repo>,
        trust_remote_code=True)` drafts with exactly this drafter, no `assistant` needed."""
        import json
        import shutil
        from importlib import resources

        from ..card import save_hub_folder
        from .rescoring.composed import save_spec

        folder = Path(path)
        settings = self.settings()
        if self.rescorer is not None:
            spec = getattr(self.rescorer, "spec", None)
            if spec is None:
                raise ValueError(
                    f"{type(self.rescorer).__name__} was not built from a spec (`hf_bpd.drafting.rescoring.composed."
                    "build_rescorer`), so it cannot be saved: save drafter.with_rescorer(None), or build it from one"
                )
            settings["rescorer"] = save_spec(spec, Path(self.rescorer.spec_folder), folder)
        card = {"top_k": self.top_k, "max_tree_tokens": self.max_tree_tokens, "self_loading": True, **card_kwargs}
        save_hub_folder(self.heads, folder, repo_id, **card)
        (folder / DRAFTER_SETTINGS).write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")
        strategy = resources.files("hf_bpd").joinpath("custom_generate")
        (folder / "custom_generate").mkdir(exist_ok=True)
        for name in ("generate.py", "requirements.txt"):
            with resources.as_file(strategy.joinpath(name)) as source:
                shutil.copy(source, folder / "custom_generate" / name)
        return folder

    def push_to_hub(
        self,
        repo_id: str,
        private: bool | None = None,
        token: str | None = None,
        commit_message: str = "Upload hf_bpd drafter",
        **card_kwargs,
    ) -> str:
        """Upload exactly the folder `save_pretrained` writes."""
        import tempfile

        from huggingface_hub import HfApi

        api = HfApi(token=token)
        api.create_repo(repo_id, private=private, exist_ok=True)
        with tempfile.TemporaryDirectory() as folder:
            self.save_pretrained(folder, repo_id, **card_kwargs)
            info = api.upload_folder(repo_id=repo_id, folder_path=folder, commit_message=commit_message)
        return str(info)

    @property
    def num_heads(self) -> int:
        return self.heads.num_heads

    def prepare(self, model, remeasure: bool = False) -> None:
        """Bind the heads to `model` (checks they fit it) and start fresh stats. Called by `generate`; call it
        before the first `generate` to do the one-time work up front (logged by the `hf_bpd` logger): on a CPU,
        building the streamed kernel and measuring the kernel plan, and for "auto" trees the forward-cost
        curve, each once per machine and model, then read from hf_bpd's cache (`hf-bpd calibrate` does this
        for a packaged model). `remeasure`: measure the curve again instead of reading the cache.
        Binding again when `model.forward` has been compiled (or uncompiled) since: the kernels change
        (`compat.compiled_forward`), so a forward-cost curve this drafter measured is measured again."""
        binding = (id(model), compiled_forward(model))
        if remeasure:
            self._bound_to = None
        if self._bound_to != binding:
            self.heads.bind(model)
            # the heads read the last hidden state: with a model split over devices (device_map) they go
            # where it comes out, beside the LM head
            device = model.get_output_embeddings().weight.device
            self.heads.to(device=device, dtype=next(model.parameters()).dtype)
            self.heads.eval()
            self.linear_context = linear_context(model, self.packed_linear)
            self._heads_context = self._heads_kernels(model)
            self._bound_to = binding
            self._remeasure_cost = self._cost_remeasured = False
            if self.max_tree_tokens == "auto" and (self.forward_cost is None or self._measured_cost):
                self._measure_forward_cost(model, refresh=remeasure)
        elif self._remeasure_cost:  # `review_forward_cost` dropped it after the last call
            self._measure_forward_cost(model)
            self._remeasure_cost, self._cost_remeasured = False, True
            if self.rescorer is not None and hasattr(self.rescorer, "bind"):
                self.rescorer.bind(model)
        self.stats = DecodingStats()
        if self.rescorer is not None and hasattr(self.rescorer, "reset"):
            self.rescorer.reset()

    def _measure_forward_cost(self, model, refresh: bool = False) -> None:
        """The forward-cost curve "auto" trees are sized by: measured once per machine, model and kernels,
        then read from the cache (`cost.cached_forward_cost`; `refresh`: measured again)."""
        t0 = time.perf_counter()
        self.forward_cost, path, measured = cached_forward_cost(
            model, packed_linear=self.packed_linear, refresh=refresh
        )
        self.setup = {"forward_cost_file": str(path), "measured": measured, "seconds": time.perf_counter() - t0}
        self._measured_cost = True

    def review_forward_cost(self) -> None:
        """After a `generate` call: where the verification forwards decoding timed put the measured curve off
        by more than `CONTRADICTED` (a curve measured beside other work, or read from a cache another load
        left), drop it from the cache and measure it again when the next call starts (once per binding:
        after that, `LearnedForwardCost` corrects it online). Only the speed depends on it, never a token."""
        cost = self._learned_cost
        if not self._measured_cost or self._cost_remeasured or cost is None or cost.curve is not self.forward_cost:
            return
        off = cost.disagreement()
        if off > CONTRADICTED:
            logger.warning(
                "the forward-cost curve in %s is %.1fx off the forwards decoding timed: it is dropped and measured "
                "again when the next call starts",
                self.setup.get("forward_cost_file"),
                off,
            )
            forget(Path(self.setup["forward_cost_file"]))
            self._remeasure_cost = True

    def _heads_kernels(self, model) -> contextlib.AbstractContextManager:
        """The context the heads run in: their own linears, and the LM-head rows they borrow, on packed
        oneDNN weights wherever the model's linears are packed, and also beside a compiled `model.forward`
        (the heads run eagerly outside its graph, so its kernels never reach them; packing only the heads
        breaks none of its guards). A no-op where the heads cannot be packed or `packed_linear=False`."""
        model_kernels = self.linear_context
        if isinstance(model_kernels, PackedLinear):
            model_plan = model_kernels.plan
            if not isinstance(model_plan, KernelPlan):  # None: packed at every row count
                return PackedLinear(self.heads)
        elif compiled_forward(model) and wants_packed_linear(self.heads, self.packed_linear):
            model_plan = KernelPlan({})
        else:
            return contextlib.nullcontext()
        tied = self.heads.__dict__.get("_tied_weight")  # the LM-head rows the heads borrow (`bind`)
        extra = () if tied is None else (tied,)
        own = cached_kernel_plan(self.heads, extra_weights=extra)[0]  # measured as the model's were
        return PackedLinear(self.heads, plan=model_plan.merged(own))

    @contextlib.contextmanager
    def exclusive(self):
        """Held by `generate` while it decodes: a drafter's stats, calibration and rescorer caches belong to
        one generation at a time, so a second concurrent one (another thread) is refused, never mixed in."""
        if not self._in_use.acquire(blocking=False):
            raise RuntimeError(
                "this BlockDrafter is already decoding another generation (another thread?): give each thread "
                "its own drafter; BlockDrafter(drafter.heads, ...) shares the heads' weights"
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
        """A drafter with these heads and settings (and forward-cost curve) and another rescorer."""
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
        )

    @property
    def step_cost(self) -> ForwardCost | LearnedForwardCost | None:
        """The forward-cost curve trees are sized by: `forward_cost`, corrected by timed forwards when
        calibrating."""
        if self.forward_cost is None or self.calibration is None:
            return self.forward_cost
        if self._learned_cost is None or self._learned_cost.curve is not self.forward_cost:
            self._learned_cost = LearnedForwardCost(self.forward_cost)
        return self._learned_cost

    def step_chooser(self, plain_estimate=None, margin: float = 0.0) -> StepChooser | None:
        """For cost-sized ("auto") trees, a `StepChooser` for one `generate` call: plain steps where drafting
        does not pay (by at least `margin`, a share). `plain_estimate()`: a plain step's seconds before one
        is timed (default: the learned one-token forward cost). None for fixed tree sizes: they draft every
        step, as asked."""
        if self.max_tree_tokens != "auto" or self.forward_cost is None:
            return None
        cost = self.step_cost
        return StepChooser(plain_estimate or (lambda: cost(1)), margin=margin)

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
            path = _best_path(tree, tree.path_logprobs(known[1], self.calibration) if scored else None)
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
        batch_cost: BatchForwardCost | None = None,
        warp: SamplingWarp | None = None,
        host_context: Sequence[Sequence[int]] | None = None,
        grown: Sequence[tuple[DraftTree, list[Arc]]] | None = None,
    ) -> list[DraftTree]:
        """One draft tree per batch row: the most probable nodes among the heads' best prefixes and the
        `rescored` drafts (drafts without estimates first); with a forward-cost curve, cut to the prefix
        with the best expected tokens per second. Probabilities are calibrated (`calibration`). "Previous"
        heads grow each tree from `hidden_last [batch, hidden]` (`expansion.expand_tree`) instead and need
        no `lattice`. `max_tokens` caps the tree below the drafter's own budget (an attention window).
        `batch_cost`: a batch verifies these trees padded to one width, with `batch_cost.rows` rows (finished
        rows included), so one width is chosen for all of them by that cost (`cost.best_batch_width`).
        `warp`: a sampled call's, for the heads' children that "previous" heads grow (see `draft`).
        `host_context`: the rows of `context` as host lists, where the caller keeps them: the root and the
        context lookup then read them instead of copying from the device. `grown`: per row, the tree
        "previous" heads already grew for this step (`grow`, read by the host) and its arcs."""
        if self.heads.conditions_on_draft and hidden_last is None and grown is None:
            raise ValueError("heads that read the drafted token grow trees from the hidden state: pass hidden_last")
        if lattice is None and not self.heads.conditions_on_draft:
            raise ValueError("these heads draft from their lattice: pass it")
        budget = self.tree_budget if max_tokens is None else max(1, min(self.tree_budget, max_tokens))
        growth = self._growth_budget(budget, 8 if batch_cost is None else 2)
        roots = context[:, -1].tolist() if host_context is None else [row[-1] for row in host_context]  # one copy
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
            estimates: dict[tuple[int, ...], float] = {}
            for path in rescored[b] if rescored is not None else []:
                toks = tuple(path.tokens[:max_depth])
                if path.token_logprobs is None:
                    tree.add_path(toks, budget)
                    continue
                for d, lp in enumerate(path.token_logprobs[: len(toks)]):
                    estimates[toks[: d + 1]] = max(lp, estimates.get(toks[: d + 1], -math.inf))
            if self.heads.conditions_on_draft and grown is not None:
                tree, arcs = grown[b]  # grown on the device during the last step, read with its tokens
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
                )
                self.stats.time_heads += time.perf_counter() - t0  # its rounds read their children on the host
            else:
                arcs = self._fill_from_lattice(tree, lattice, b, budget, max_depth, estimates)
            if self.context_lookup and arcs is not None:
                limit = self.context_lookup if max_depth is None else min(self.context_lookup, max_depth)
                tokens = context[b].cpu().numpy() if row is None else np.asarray(row)
                chain, ngram = lookup_continuation(tokens, limit)
                tree, arcs = merge_lookup(tree, arcs, chain, ngram, self.calibration, budget)
            trees.append(tree)
            node_arcs.append(arcs)
        if self.forward_cost is not None:
            trees = self._sized(trees, node_arcs, batch_cost)
        for tree, arcs in zip(trees, node_arcs):
            known = arcs is not None and self.calibration is not None
            self._verified.append((tree, arcs[: len(tree)]) if known else None)  # a prefix keeps node indices
        return trees

    def cut(self, trees: Sequence[DraftTree], limit: int | None) -> list[DraftTree]:
        """`trees` cut to at most `limit` nodes each (None: as they are), with what `observe` will score cut
        alike: a tree grown a step ahead (`grow`) was grown before its step's limit was known."""
        if limit is None or all(len(tree) <= limit for tree in trees):
            return list(trees)
        for b, verified in enumerate(self._verified):
            if verified is not None and len(verified[0]) > limit:
                self._verified[b] = (verified[0].truncated(limit), verified[1][:limit])
        return [tree.truncated(limit) if len(tree) > limit else tree for tree in trees]

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
            budget = self._growth_budget(self.tree_budget)
        log_scales = [0.0] * (self.heads.num_heads + 1)
        if self.calibration is not None:
            self.calibration.regime = GREEDY if warp is None else SAMPLED
            log_scales[1:] = [math.log(self.calibration.scale(HEADS, d)) for d in range(1, len(log_scales))]
        with self._heads_context:
            hidden = hidden.to(self.heads.device, self.heads.dtype)
            return grow_on_device(self.heads, hidden, root, self.top_k, budget, log_scales, warp, max_depth)

    def _sized(self, trees: list[DraftTree], node_arcs: list, batch_cost: BatchForwardCost | None) -> list[DraftTree]:
        """Cut each tree to the prefix with the best expected tokens per second of the verification forward:
        per tree for one row, or one common width for a batch forward (`batch_cost`)."""
        probs = [
            [math.exp(lp) for lp in tree.path_logprobs(arcs, self.calibration)] if len(tree) > 1 else [1.0]
            for tree, arcs in zip(trees, node_arcs)
        ]
        if batch_cost is None:
            sizes = [best_tree_size(p, self.step_cost) for p in probs]
        else:
            width = best_batch_width(probs, batch_cost.rows, batch_cost, batch_cost.max_width(), batch_cost.margin)
            sizes = [min(width, len(tree)) for tree in trees]
        trees = [tree.truncated(n) if n < len(tree) else tree for tree, n in zip(trees, sizes)]
        self._recent_sizes.extend(len(tree) for tree, n in zip(trees, probs) if len(n) > 1)
        return trees

    def _growth_budget(self, budget: int, floor: int = 8) -> int:
        """Nodes to grow for a tree that the forward-cost curve will cut: each expansion round costs head
        calls, so grow at most 1.5 times the largest tree of the last steps (at least `floor`; all of
        `budget` without a curve or before any step). Self-correcting: a tree cut at that bound raises it.
        Batches pass a floor of 2: every row pays its own head calls, and a compute-bound batch forward
        often affords single tokens only, so growing 8 nodes per row would be wasted."""
        if self.forward_cost is None or not self._recent_sizes:
            return budget
        return min(budget, max(floor, (3 * max(self._recent_sizes) + 1) // 2))

    def _fill_from_lattice(
        self,
        tree: DraftTree,
        lattice: Lattice,
        b: int,
        budget: int,
        max_depth: int | None,
        estimates: dict[tuple[int, ...], float],
    ) -> list[Arc] | None:
        """Fill `tree` up to `budget` with row `b`'s best lattice prefixes (ordered against the rescorer's
        `estimates` when there are any). Returns each node's arc where something reads them (tree sizing,
        calibration, or the context-lookup chain, which competes with the heads' nodes on them), else None."""
        tables = None
        if estimates or self.forward_cost is not None or self.context_lookup:
            tokens, logprobs = lattice.row(b)
            tables = [dict(zip(t, lp)) for t, lp in zip(tokens, logprobs)]
        if len(tree) < budget:
            drafts = [p.tokens for p in lattice.best_prefixes(b, budget - 1, max_depth)]
            if estimates:
                drafts = _by_estimated_probability(tree.tokens[0], drafts, estimates, tables, self.calibration)
            for draft in drafts:
                tree.add_path(draft, budget)
                if len(tree) >= budget:
                    break
        # each node's arc, once: it sizes the tree and, kept, lets `observe` score the verification
        needed = tables is not None and (
            self.forward_cost is not None or self.calibration is not None or self.context_lookup > 0
        )
        return tree.node_arcs(tables, estimates, self.calibration) if needed else None

    def observe(
        self, accepted_nodes: list[list[int]], finished: list[bool], tree_tokens: int, seconds: float | None
    ) -> None:
        """Feed back one verification step: per row, the tree nodes the base model accepted (root first)
        and whether decoding stopped at the last of them (then its children were never compared); the
        forward's tree width and its time (None when it was not timed reliably). Updates the
        calibration with every drafted child of a reached node, and the learned forward cost."""
        if self.calibration is None:
            return
        cost = self.step_cost
        if seconds is not None and isinstance(cost, LearnedForwardCost):
            cost.observe(tree_tokens, seconds)
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
        batch_cost: BatchForwardCost | None = None,
        warp: SamplingWarp | None = None,
        host_context: Sequence[Sequence[int]] | None = None,
        grown: Sequence[tuple[DraftTree, list[Arc]]] | None = None,
    ) -> Sequence[DraftTree]:
        """Heads -> lattice -> trees (at most `max_tokens` nodes each, when given; `batch_cost`: see
        `tree`), timing each phase into `stats`. `warp`: the sampled call's (`SamplingWarp.from_config`;
        None when greedy): the heads' estimates are warped like the base model's draws, and calibrated
        in the sampled regime. `host_context`, `grown`: see `tree`."""
        t0 = self._sync(hidden_last.device)
        if self.calibration is not None:
            self.calibration.regime = GREEDY if warp is None else SAMPLED
        # "previous" heads draft the tree node by node; their chain lattice only serves a rescorer
        needs_lattice = self.rescorer is not None or not self.heads.conditions_on_draft
        needs_lattice = needs_lattice and grown is None
        lattice_warp = None if self.heads.conditions_on_draft else warp
        with self._heads_context:
            lattice = self.lattice(hidden_last, context[:, -1], context, lattice_warp) if needs_lattice else None
        t1 = self._sync(hidden_last.device)
        rescored = self.rescore(lattice, context)
        heads_before = self.stats.time_heads
        t2 = time.perf_counter()
        with self._heads_context:
            trees = self.tree(
                lattice, context, max_depth, rescored, hidden_last, max_tokens, batch_cost, warp, host_context, grown
            )
        t3 = time.perf_counter()
        # "previous" heads grow the tree inside `tree`, which books that as heads time (as a fused greedy
        # step's accept does, `decoding.accept_greedy_and_grow`): the tree phase is the rest
        self.stats.time_tree += t3 - t2 - (self.stats.time_heads - heads_before)
        self.stats.time_heads += t1 - t0
        self.stats.time_rescore += t2 - t1
        return trees


def _best_path(tree: DraftTree, logprobs: list[float] | None) -> list[int]:
    """Node indices from the root to the leaf whose path has the most expected accepted tokens (the sum of
    exp(path log-probability) over its nodes), or, without `logprobs`, following each node's first child."""
    if logprobs is None:
        path = [0]
        while (
            child := next((i for i in range(path[-1] + 1, len(tree)) if tree.parents[i] == path[-1]), None)
        ) is not None:
            path.append(child)
        return path
    gain = [0.0] * len(tree)
    for i in range(1, len(tree)):
        gain[i] = gain[tree.parents[i]] + math.exp(logprobs[i])
    return tree.path_to(max(range(len(tree)), key=lambda i: (gain[i], -i)))


def _by_estimated_probability(
    root: int,
    drafts: list[tuple[int, ...]],
    estimates: dict[tuple[int, ...], float],
    tables: list[dict[int, float]],
    calibration: AcceptanceCalibration | None = None,
) -> list[tuple[int, ...]]:
    """Every candidate draft (the heads' prefixes and each prefix of the rescored drafts), most probable
    first. A child is never more probable than its parent (depth breaks ties), so each draft's prefixes
    come before it."""
    candidates = DraftTree.root_only(root)
    for draft in [*drafts, *estimates]:
        candidates.add_path(draft, len(drafts) + len(estimates) + 1)
    logprobs = candidates.node_logprobs(tables, estimates, calibration)
    paths = candidates.node_paths()
    order = sorted(range(1, len(candidates)), key=lambda i: (-logprobs[i], candidates.depths[i]))
    return [paths[i] for i in order]


DRAFTER_SETTINGS = "drafter.json"


def _drafter_settings(path: str | Path, hub: dict) -> tuple[Path, dict]:
    """(the folder holding the drafter's files, the settings of its `drafter.json`, or {} without one)."""
    import json

    folder = Path(path)
    if not folder.is_dir():  # a Hub repo id: the whole repo, so a rescorer's files come along
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(str(path), **hub))
    settings_file = folder / DRAFTER_SETTINGS
    return folder, json.loads(settings_file.read_text(encoding="utf-8")) if settings_file.is_file() else {}
