"""A drafter bound to the base model it decodes (`prepare`, called by `generate` at each call):

- the heads checked against the model and moved beside its LM head;
- the kernels: the context the whole decode runs in (`linear_context`: oneDNN packed weights on a CPU,
  `packed_linear.py`) and the one the heads run in (`heads_kernels`, handed to the drafter as
  `BlockDrafter.heads_context`);
- the forward-cost curve "auto" trees are sized by: measured once per machine, model and kernels, then read
  from hf_bpd's cache, measured again where decoding's timed forwards contradict it
  (`ModelBinding.review_forward_cost`), and corrected online by them (`step_cost`, a `LearnedForwardCost`
  when calibrating), which the loops hand to `BlockDrafter.draft` to size each step's trees by;
- the `StepChooser` of a call with cost-sized trees (`ModelBinding.step_chooser`).

A drafter keeps one binding across `generate` calls (`binding_of`): rebinding happens only for another
model, or where `model.forward` was compiled (or uncompiled) since, as the kernels change then.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from pathlib import Path

from ..compat import compiled_forward
from ..cpu.packed_linear import KernelPlan, PackedLinear, cached_kernel_plan, linear_context, wants_packed_linear
from ..disk_cache import forget
from ..drafting.drafter import BlockDrafter
from ..drafting.heads import BlockDraftHeads
from ..log import logger
from .cost import ForwardCost, LearnedForwardCost, StepChooser, cached_forward_cost
from .stats import DecodingStats

# a measured forward-cost curve this far off the forwards decoding timed is measured again
# (`review_forward_cost`): well above what a longer context than the measurement's adds
CONTRADICTED = 2.0


class ModelBinding:
    """What one drafter keeps of the base model it decodes, across `generate` calls (module docstring)."""

    def __init__(self) -> None:
        # (id of the model, whether its forward was compiled, its LM head's device and dtype): a model moved
        # or cast since (`model.to`) is bound again, its heads and kernels following it
        self.bound_to: tuple | None = None
        # the context the decode runs in (oneDNN packed weights or none)
        self.linear_context: contextlib.AbstractContextManager = contextlib.nullcontext()
        self.measured_cost = False  # the drafter's forward_cost was measured here (not given): re-measured on rebinding
        # decoding contradicted the measured curve: measure it at the next call; and whether that happened in this
        # binding (`review_forward_cost`)
        self.remeasure_cost = self.cost_remeasured = False
        self.setup: dict = {}  # one-time start-up work of the last `prepare` that did any (forward-cost curve)
        self.learned_cost: LearnedForwardCost | None = None
        # the cost the call's trees are sized by: the drafter's forward_cost, corrected by timed forwards when
        # calibrating (set by `bind`)
        self.step_cost: ForwardCost | LearnedForwardCost | None = None

    def bind(self, drafter: BlockDrafter, model, remeasure: bool = False) -> None:
        """`prepare`'s work: see there."""
        weight = model.get_output_embeddings().weight
        binding = (id(model), compiled_forward(model), weight.device, weight.dtype)
        if remeasure:
            self.bound_to = None
        if self.bound_to != binding:
            heads = drafter.heads
            heads.bind(model)
            # the heads read the last hidden state: with a model split over devices (device_map) they go
            # where it comes out, beside the LM head
            heads.to(device=weight.device, dtype=next(model.parameters()).dtype)
            heads.eval()
            self.linear_context = linear_context(model, drafter.packed_linear)
            drafter.heads_context = heads_kernels(
                heads, model, self.linear_context, drafter.packed_linear, drafter.compact_weights
            )
            self.bound_to = binding
            self.remeasure_cost = self.cost_remeasured = False
            # a rescorer checks that it fits the model, and one saved as layers only is rebuilt on it
            if drafter.rescorer is not None and hasattr(drafter.rescorer, "bind"):
                drafter.rescorer.bind(model)
            if drafter.max_tree_tokens == "auto" and (drafter.forward_cost is None or self.measured_cost):
                self.measure_forward_cost(drafter, model, refresh=remeasure)
        elif self.remeasure_cost:  # `review_forward_cost` dropped it after the last call
            self.measure_forward_cost(drafter, model)
            self.remeasure_cost, self.cost_remeasured = False, True
        drafter.stats = DecodingStats()
        drafter.start_call()
        if drafter.rescorer is not None and hasattr(drafter.rescorer, "reset"):
            drafter.rescorer.reset()
        self.step_cost = self.corrected_cost(drafter)

    def measure_forward_cost(self, drafter: BlockDrafter, model, refresh: bool = False) -> None:
        """The forward-cost curve "auto" trees are sized by, into `drafter.forward_cost`: measured once per
        machine, model and kernels, then read from the cache (`cost.cached_forward_cost`; `refresh`: measured
        again)."""
        t0 = time.perf_counter()
        drafter.forward_cost, path, measured = cached_forward_cost(
            model, packed_linear=drafter.packed_linear, refresh=refresh
        )
        self.setup = {"forward_cost_file": str(path), "measured": measured, "seconds": time.perf_counter() - t0}
        self.measured_cost = True

    def corrected_cost(self, drafter: BlockDrafter) -> ForwardCost | LearnedForwardCost | None:
        """The forward-cost curve trees are sized by: `drafter.forward_cost`, corrected by timed forwards when
        calibrating (one `LearnedForwardCost` per curve, kept across calls)."""
        if drafter.forward_cost is None or drafter.calibration is None:
            return drafter.forward_cost
        if self.learned_cost is None or self.learned_cost.curve is not drafter.forward_cost:
            self.learned_cost = LearnedForwardCost(drafter.forward_cost)
        return self.learned_cost

    def observe_forward(self, tree_tokens: int, seconds: float | None) -> None:
        """One verification forward of `tree_tokens` and its time (None when it was not timed reliably): it
        corrects the learned forward cost, where there is one."""
        if seconds is not None and isinstance(self.step_cost, LearnedForwardCost):
            self.step_cost.observe(tree_tokens, seconds)

    def review_forward_cost(self, drafter: BlockDrafter) -> None:
        """After a `generate` call: where the verification forwards decoding timed put the measured curve off
        by more than `CONTRADICTED` (a curve measured beside other work, or read from a cache another load
        left), drop it from the cache and measure it again when the next call starts (once per binding:
        after that, `LearnedForwardCost` corrects it online). Only the speed depends on it, never a token."""
        cost = self.learned_cost
        if not self.measured_cost or self.cost_remeasured or cost is None or cost.curve is not drafter.forward_cost:
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
            self.remeasure_cost = True

    def step_chooser(
        self, drafter: BlockDrafter, plain_estimate, margin: float, probes: tuple[int, int]
    ) -> StepChooser | None:
        """For cost-sized ("auto") trees, a `StepChooser` for one `generate` call: plain steps where drafting
        does not pay (by at least `margin`, a share). `plain_estimate()`: a plain step's seconds before one
        is timed (None: the learned one-token forward cost). `probes`: plain steps before drafting is
        probed, and the longest wait (`cost.ROW_PROBES`, `cost.BATCH_PROBES`). None for fixed tree sizes:
        they draft every step, as asked."""
        if drafter.max_tree_tokens != "auto" or drafter.forward_cost is None:
            return None
        cost = self.step_cost
        every, longest = probes
        return StepChooser(plain_estimate or (lambda: cost(1)), every, longest, margin=margin)


def heads_kernels(
    heads: BlockDraftHeads,
    model,
    model_kernels: contextlib.AbstractContextManager,
    packed_linear: bool | None,
    compact_weights: bool = False,
) -> contextlib.AbstractContextManager:
    """The context the heads run in: their own linears, and the LM-head rows they borrow, on packed
    oneDNN weights wherever the model's linears are packed (`model_kernels`), and also beside a compiled
    `model.forward` (the heads run eagerly outside its graph, so its kernels never reach them; packing only
    the heads breaks none of its guards), their plan measured on weights of their precision (`compact_weights`).
    A no-op where the heads cannot be packed or `packed_linear=False`."""
    if isinstance(model_kernels, PackedLinear):
        model_plan = model_kernels.plan
        if not isinstance(model_plan, KernelPlan):  # None: packed at every row count
            return PackedLinear(heads)
    elif compiled_forward(model) and wants_packed_linear(heads, packed_linear):
        model_plan = KernelPlan({})
    else:
        return contextlib.nullcontext()
    weights = "q8_0" if compact_weights else None
    extra = heads.packed_extra_weights()  # the borrowed LM-head rows (an EAGLE layer's stacked weights too)
    own = cached_kernel_plan(heads, extra_weights=extra, weights=weights)[0]  # measured as the model's were
    return PackedLinear(heads, plan=model_plan.merged(own))


_BINDINGS: weakref.WeakKeyDictionary[BlockDrafter, ModelBinding] = weakref.WeakKeyDictionary()


def binding_of(drafter: BlockDrafter) -> ModelBinding:
    """The drafter's binding, kept as long as the drafter lives (a fresh, unbound one the first time)."""
    binding = _BINDINGS.get(drafter)
    if binding is None:
        binding = _BINDINGS[drafter] = ModelBinding()
    return binding


def prepare(drafter: BlockDrafter, model, remeasure: bool = False) -> ModelBinding:
    """Bind the drafter's heads to `model` (checks they fit it) and start fresh stats (`drafter.stats`).
    Called by `generate`; call it before the first `generate` to do the one-time work up front (logged by
    the `hf_bpd` logger, and in the returned binding's `setup`): on a CPU, building the streamed kernel and
    measuring the kernel plan, and for "auto" trees the forward-cost curve, each once per machine and model,
    then read from hf_bpd's cache (`hf-bpd calibrate` does this for a packaged model). `remeasure`: measure
    the curve again instead of reading the cache. Binding again when `model.forward` has been compiled (or
    uncompiled) since: the kernels change (`compat.compiled_forward`), so a forward-cost curve measured for
    this drafter is measured again. An EAGLE layer's fallback heads are bound with it, so that a call they
    decode does its one-time work here too."""
    if drafter.fallback is not None:
        prepare(drafter.fallback, model, remeasure)
    binding = binding_of(drafter)
    binding.bind(drafter, model, remeasure)
    return binding
