"""Pre-packed oneDNN linear layers on a CPU: fast kernels for every forward, drafted or plain.

Why: BLAS can treat the skinny matrices of decoding badly on a CPU. A one-token forward runs every weight
through a matrix-vector kernel, and 2 to 16 rows through a GEMM that may re-pack each weight on every
call. oneDNN with each weight reordered once into its blocked layout (what `torch.compile` does on a CPU)
avoids that, and on x86-64 with AVX2 hf_bpd's own `streamed_linear` kernel streams each weight once for
up to 12 rows (16 on AVX-512) with its arithmetic overlapped. Which one wins depends on the processor, the
weight shape and the row count, so the choice is measured on the model itself, once per machine
(`KernelPlan`, `cached_kernel_plan`), and each shape keeps one packed copy (oneDNN's or the streamed
kernel's panels).
`RESULTS.md` has the measured costs.

Two ways in, one packed copy per model (`fast_cpu(model)` and the drafter share it):
- `with hf_bpd.fast_cpu(model): model.generate(...)`: any `generate` call (greedy, sampling, beams,
  transformers' assisted and prompt-lookup decoding) runs every forward, prefill and one-token steps
  included, on the packed weights. Plain decoding gets the same kernels the drafter uses, so hf_bpd's
  speedups are measured against it.
- `BlockDrafter(packed_linear=None)` ("auto", the default): hf_bpd's whole decode (prefill, heads, tree
  forwards) runs inside that same block.

Inside a block the float32 CPU `nn.Linear` layers of the wrapped modules run oneDNN's `_linear_pointwise`
on a packed copy of their weight, made on first use, for every row count where the plan says it is faster
(BLAS otherwise). A model's shared block (the two ways in above) also runs its `sdpa` attention layers
on `grouped_attention`: a masked forward of several tokens (a tree, a prompt-lookup draft, a batch step)
attends on the cached key/value heads instead of copying the cache once per query head, and host memory
freed by one layer is reused by the next (`host_memory`). No modeling file is copied or changed, and
outside the block the model is exactly as loaded. The packed kernel rounds differently from BLAS, as any
other kernel or batch shape does, so an output can differ from plain `generate`'s where two logits nearly
tie; `benchmarks/speed` measures how often.

The cost is memory: a second copy of every linear weight the forward uses (about the model's size), kept
between blocks until `clear()`. The original weights stay: they serve calls outside the block, autograd,
tied embeddings and `state_dict`. A weight changed in place after packing (its `_version` moves) is
packed again, never used stale.

Compiled graphs (`torch.compile` of a forward inside a block, such as hf_bpd's captured decode step on a
CPU): the packed kernels are custom ops there (`onednn_linear`, `streamed_linear.OP`), so the graph has
no break and runs the plan's kernels. A trace cannot pack: `PackedLinear.pack_planned()` packs every
weight the plan uses before it, and the graph keeps the copies it was traced with (a weight changed in
place afterwards needs a new compile, as inductor's frozen weights do).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import weakref
from bisect import bisect_left
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import log
from ..compat import compiled_forward
from ..disk_cache import cache_file, machine_key, measured_once
from . import streamed_linear
from .grouped_attention import grouped_attention
from .host_memory import reuse_freed_memory

# the row count oneDNN packs for (any count works): the trees `auto` verifies on the dev CPU have 2-16 tokens
PACK_ROWS = 8
# "auto" packs models whose float32 parameters take at most this much: the packed copy doubles their memory
AUTO_MAX_BYTES = 2 * 1024**3

ONEDNN_OP = "hf_bpd::onednn_linear"  # oneDNN's packed linear as a custom op, for compiled graphs (`onednn_linear`)

_MODES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its PackedLinear, shared by drafters
_THREAD = threading.local()  # the PackedLinear blocks open in this thread, innermost last


@functools.cache
def packed_linear_available() -> bool:
    """oneDNN is built into this torch and its packed linear ops work as this module calls them. They are
    private ops (the ones `torch.compile` uses on a CPU), so a torch release that changes them turns the
    feature off ("auto") or into a clear error (True) instead of breaking decoding."""
    mkldnn = getattr(torch.ops, "mkldnn", None)
    if not torch.backends.mkldnn.is_available() or mkldnn is None:
        return False
    try:
        g = torch.Generator().manual_seed(0)  # never the global stream: a user's seeded sampling must not move
        weight, bias, x = (torch.randn(*shape, generator=g) for shape in ((24, 16), (24,), (3, 16)))
        packed = mkldnn._reorder_linear_weight(weight, PACK_ROWS)
        out = mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        return bool(torch.allclose(out, F.linear(x, weight, bias), rtol=1e-4, atol=1e-4))
    except (AttributeError, RuntimeError, TypeError):
        return False


@torch.library.custom_op(ONEDNN_OP, mutates_args=())
def onednn_linear(
    rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """oneDNN's linear on a weight packed by `_reorder_linear_weight`, as a custom op that a `torch.compile`
    graph keeps as it is, the way `streamed_linear.OP` keeps the streamed kernel: inductor's own lowering
    of `mkldnn._linear_pointwise` takes only weights it froze into the graph itself, not packed copies
    that come in as inputs. What `PackedLinear.apply` calls inside a trace; eagerly it calls oneDNN."""
    return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")


@onednn_linear.register_fake
def _(rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    torch._check(rows.dim() == 2, lambda: f"{ONEDNN_OP} takes 2D rows [M, K]")
    return rows.new_empty(rows.shape[0], out_features)


@dataclass(frozen=True)
class RowPlan:
    """Which kernel serves one weight shape by row count (tokens x batch rows of the forward): `packed[i]`
    says oneDNN's packed weight beat BLAS at `sizes[i]` rows. A call takes the decision of the smallest
    measured size >= its rows (the largest size beyond them)."""

    sizes: tuple[int, ...]
    packed: tuple[bool, ...]

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.packed) or not self.sizes or list(self.sizes) != sorted(self.sizes):
            raise ValueError("RowPlan needs increasing sizes with one decision each")

    def __call__(self, rows: int) -> bool:
        if torch.compiler.is_compiling():
            # compared only where the decision changes: each comparison of a traced row count is a guard of
            # the graph, so one graph then serves every row count of one decision (comparing with every
            # size would pin the count between two sizes, and 2 rows to exactly 2: a graph per tree size)
            for size, packed, following in zip(self.sizes, self.packed, self.packed[1:]):
                if packed != following and rows <= size:
                    return packed
            return self.packed[-1]
        return self.packed[min(bisect_left(self.sizes, rows), len(self.sizes) - 1)]

    @property
    def description(self) -> str:
        """e.g. "BLAS for 1-2 rows, packed for 3+ rows"."""
        parts, start = [], 0
        for i in range(1, len(self.sizes) + 1):
            if i == len(self.sizes) or self.packed[i] != self.packed[start]:
                lo = 1 if start == 0 else self.sizes[start - 1] + 1
                hi = self.sizes[i - 1] if i < len(self.sizes) else None
                span = f"{lo}+" if hi is None else (f"{lo}" if lo == hi else f"{lo}-{hi}")
                parts.append(f"{'packed' if self.packed[start] else 'BLAS'} for {span} rows")
                start = i
        return ", ".join(parts)


ONEDNN, STREAMED = "onednn", "streamed"  # the packed copy a weight shape keeps (`KernelPlan.formats`)


@dataclass(frozen=True)
class KernelPlan:
    """Which kernel serves each linear call: a `RowPlan` per weight shape (out, in), measured on the model
    itself (`measure_kernel_plan`): a large output layer that streams from memory and a small layer that
    stays in the CPU's caches can want different kernels at the same row count. A shape not measured
    stays with BLAS. `formats` says which packed copy a shape keeps, one per shape: oneDNN's blocked
    weight (`ONEDNN`, the default) or `streamed_linear`'s panels (`STREAMED`); its `RowPlan` says for
    which row counts that copy beats BLAS."""

    shapes: dict[tuple[int, int], RowPlan]
    formats: dict[tuple[int, int], str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = set(self.formats.values()) - {ONEDNN, STREAMED}
        if unknown:
            raise ValueError(f"unknown packed formats {sorted(unknown)}: {ONEDNN!r} or {STREAMED!r}")

    def __call__(self, rows: int, shape: tuple[int, ...]) -> bool:
        plan = self.shapes.get(tuple(shape))
        return plan is not None and plan(rows)

    def format(self, shape: tuple[int, ...]) -> str:
        """The packed copy weights of `shape` keep."""
        return self.formats.get(tuple(shape), ONEDNN)

    def merged(self, other: KernelPlan) -> KernelPlan:
        """This plan with `other`'s shapes added (`other` wins where both have one)."""
        return KernelPlan({**self.shapes, **other.shapes}, {**self.formats, **other.formats})

    @property
    def description(self) -> str:
        """e.g. "49152x576: BLAS for 1 rows, packed for 2+ rows; 576x576: BLAS for 1+ rows"; a shape on
        `streamed_linear`'s panels says "streamed" where others say "packed"."""
        parts = []
        for (o, i), plan in sorted(self.shapes.items(), reverse=True):
            kind = "streamed" if self.format((o, i)) == STREAMED else "packed"
            parts.append(f"{o}x{i}: {plan.description.replace('packed', kind)}")
        return "; ".join(parts)

    @property
    def packs_anything(self) -> bool:
        return any(any(plan.packed) for plan in self.shapes.values())


class PackedLinear:
    """Route the `nn.Linear` layers of `modules` through oneDNN with packed weights inside `with` blocks
    (see the module docstring); outside them the layers are untouched.

    Inside a block each layer's `forward` is an instance attribute (the way accelerate's hooks wrap a
    module), removed again on exit; a class-wide mode (`TorchFunctionMode`) would add a Python call to each
    of a forward's ~2,400 torch calls, about 10 ms, eating the gain. Reusable: the packed weights are kept
    between blocks (`clear()` frees them). Calls it cannot serve (another dtype or device, autograd) run
    the layer's own forward. While a block is open, another thread calling the same layers
    also gets the packed path (same numbers up to rounding).
    """

    def __init__(
        self,
        *modules: torch.nn.Module,
        plan: KernelPlan | None = None,
        grouped_attention_of: torch.nn.Module | None = None,
    ) -> None:
        if not packed_linear_available():
            raise RuntimeError("this torch build has no oneDNN packed linear ops (torch.ops.mkldnn)")
        self.layers = [m for module in modules for m in module.modules() if type(m) is torch.nn.Linear]
        self._all_forwards = [(layer, functools.partial(self.linear, layer)) for layer in self.layers]  # made once
        # id(weight) -> (weight, its _version when packed, packed weight or None when it cannot be served,
        # its format: ONEDNN or STREAMED)
        self._packed: dict[int, tuple[torch.Tensor, int, torch.Tensor | None, str]] = {}
        self._depth = 0
        self.plan = plan
        # a model whose `sdpa` layers run `grouped_attention` and whose host memory is reused inside the block
        # (the shared block of a model)
        self._attention_model = grouped_attention_of
        self._model_wide = contextlib.ExitStack()  # grouped attention and host memory, in a shared block

    @property
    def plan(self) -> KernelPlan | None:
        """Which kernel serves which call (`KernelPlan`); None: packed for every row count. Set it between
        blocks: a block patches only the layers whose shape the plan packs at some row count, so a layer
        that always stays with BLAS keeps its own forward and costs nothing extra."""
        return self._plan

    @plan.setter
    def plan(self, plan: KernelPlan | None) -> None:
        self._plan = plan
        # a copy packed in another format than the new plan gives its shape is marked stale (packed again on
        # its next use), so the per-call path never has to look the format up
        for key, (weight, _, packed, kind) in list(self._packed.items()):
            if kind != self._format(weight.shape):
                self._packed[key] = (weight, -1, packed, kind)
        shapes = getattr(plan, "shapes", None)  # another callable (a test's): every layer
        self._forwards = [
            (layer, forward)
            for layer, forward in self._all_forwards
            if shapes is None or any(getattr(shapes.get(tuple(layer.weight.shape)), "packed", ()))
        ]

    def __len__(self) -> int:
        """Weights packed so far."""
        return sum(entry[2] is not None for entry in self._packed.values())

    @property
    def packed_bytes(self) -> int:
        """Memory the packed copies hold (the price of the block, on top of the model's own weights)."""
        return sum(e[2].numel() * e[2].element_size() for e in self._packed.values() if e[2] is not None)

    def clear(self) -> None:
        """Free the packed copies (the next block packs again on first use)."""
        self._packed.clear()

    def packed(self, weight: torch.Tensor) -> torch.Tensor | None:
        """`weight` in the plan's packed format for its shape (oneDNN's blocked layout unless the plan says
        `STREAMED`), packed on first use and again after an in-place change or a new plan; None
        for a weight it cannot serve (not a plain 2D float32 CPU tensor). Checked once per packing, not
        per call."""
        return self._entry(weight)[2]

    def _format(self, shape: tuple[int, ...]) -> str:
        """The packed format of weights of `shape` under the current plan."""
        format_of = getattr(self._plan, "format", None)  # None: no plan, or a test's callable
        return ONEDNN if format_of is None else format_of(shape)

    def _entry(self, weight: torch.Tensor) -> tuple[torch.Tensor, int, torch.Tensor | None, str]:
        entry = self._packed.get(id(weight))
        if torch.compiler.is_compiling():
            # a traced forward reads the copies packed before it (`pack_planned`), as they are: packing is
            # no graph op, and the graph holds them as its constants (inductor's frozen weights do the same)
            return entry if entry is not None and entry[0] is weight else (weight, 0, None, ONEDNN)
        if entry is None or entry[0] is not weight or entry[1] != weight._version:
            kind = self._format(weight.shape)
            servable = (
                type(weight) in (torch.Tensor, torch.nn.Parameter)
                and weight.dim() == 2
                and weight.dtype == torch.float32
                and weight.device.type == "cpu"
                and weight.layout == torch.strided
            )
            packed = None
            if servable:
                if kind == STREAMED:
                    packed = streamed_linear.pack(weight)
                else:
                    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)
            entry = (weight, weight._version, packed, kind)
            self._packed[id(weight)] = entry
        return entry

    def pack_planned(self, extra_weights: tuple[torch.Tensor, ...] = ()) -> int:
        """Pack now every weight of the layers (and `extra_weights`: linears that are no `nn.Linear`, such as
        the heads' borrowed LM head) whose shape the plan packs at some row count (all of them without a
        plan), unless packed already: what a `torch.compile` trace of a forward inside a block needs, since
        a traced forward only reads the packed copies (one packed later is used from its next compile on).
        Returns the weights packed so far."""
        shapes = getattr(self._plan, "shapes", None)
        for weight in [layer.weight for layer in self.layers] + list(extra_weights):
            if shapes is None or any(getattr(shapes.get(tuple(weight.shape)), "packed", ())):
                self._entry(weight)
        return len(self)

    def apply(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`F.linear(x, weight, bias)`, on the packed weight where servable (float32 on the CPU, outside
        autograd: the packed op has no backward) and where the plan says packing is faster for this many
        rows."""
        if (
            type(x) is torch.Tensor
            and x.dim() > 0
            and (self._plan is None or self._plan(x.numel() // max(x.shape[-1], 1), weight.shape))
            and x.dtype == torch.float32
            and x.device.type == "cpu"
            and (bias is None or (bias.dtype == torch.float32 and bias.device.type == "cpu"))
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        ):
            _, _, packed, kind = self._entry(weight)
            if packed is not None:
                if kind == STREAMED:
                    return streamed_linear.linear(x, packed, weight.shape[0], bias)
                rows = x.reshape(-1, x.shape[-1])  # a 1D input is one row
                if torch.compiler.is_compiling():
                    out = torch.ops.hf_bpd.onednn_linear(rows, packed, bias, weight.shape[0])
                else:
                    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
                return out.reshape(*x.shape[:-1], weight.shape[0])
        return F.linear(x, weight, bias)

    def linear(self, layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """What `layer(x)` runs inside a block."""
        return self.apply(x, layer.weight, layer.bias)

    def __enter__(self) -> PackedLinear:
        if self._depth == 0:
            for layer, forward in self._forwards:
                layer.__dict__["forward"] = forward  # the instance attribute shadows the class's forward
            if self._attention_model is not None:
                self._model_wide.enter_context(grouped_attention(self._attention_model))
                self._model_wide.enter_context(reuse_freed_memory())
        self._depth += 1
        _active().append(self)
        return self

    def __exit__(self, *exc) -> None:
        _active().pop()
        self._depth -= 1
        if self._depth == 0:
            for layer in self.layers:
                layer.__dict__.pop("forward", None)
            self._model_wide.close()


# rows of one forward (tokens, trees, batches); more rows (prefills) take the 64-row decision: on the dev
# CPU the decisions at 64 and 256 rows agreed for every shape of both packaged models, and timing 256 rows
# took a third of the plan's time
KERNEL_PLAN_SIZES = (1, 2, 4, 8, 16, 32, 64)
# packed weights must beat BLAS by this factor to be used: a tie within noise keeps BLAS, which costs no copy
PACKED_MARGIN = 0.97
# the most rows `streamed_linear` is measured at: it re-reads each panel once per 12 rows (16 on AVX-512), a
# kernel for decoding's few rows, not for prefills (where BLAS and oneDNN run at the CPU's arithmetic rate); on
# the dev CPU it never beat BLAS at 32 or 64 rows, and timing it there cost a sixth of the plan's time
STREAMED_MAX_ROWS = 16
# the bytes of one shape's weights a kernel plan times (`streaming_sample`): twice a large server CPU's
# last-level cache, so the sample streams from memory as a forward's weights do
SAMPLE_BYTES = 64 << 20


@torch.no_grad()
def measure_kernel_plan(
    model,
    sizes=KERNEL_PLAN_SIZES,
    repeats: int = 3,
    extra_weights: tuple[torch.Tensor, ...] = (),
    progress: bool = False,
) -> KernelPlan:
    """For each weight shape of `model`'s linear layers (and of `extra_weights`, linears that are no `nn.Linear`,
    such as heads' borrowed LM-head rows) and each row count in `sizes`, which kernel runs the weights of that
    shape fastest, timed in turn as a forward runs them (a sample of them that still streams from memory as they
    do there, `streaming_sample`): BLAS, oneDNN's packed copies, or `streamed_linear`'s panels (where that
    kernel is available, up to `STREAMED_MAX_ROWS` rows); medians of `repeats` passes each, the kernels
    alternating so that drift hits them alike. A shape keeps one packed copy: the format that saves more over
    BLAS across the row counts of decoding (at most 16 rows), used where it beats BLAS by `PACKED_MARGIN`. The
    linears are timed on their own, not through the model's forward: the choice concerns them only, and any
    architecture (windows, recurrent state, multimodal parts) is measured the same way. `progress`: draw a bar
    (`log.progress`)."""
    packed = PackedLinear(model)  # its own copies, packed at every row count: freed when this returns
    weights = {id(layer.weight): (layer.weight, layer.bias) for layer in packed.layers}
    weights.update({id(w): (w, None) for w in extra_weights})
    by_shape: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor | None]]] = {}
    for weight, bias in weights.values():
        by_shape.setdefault(tuple(weight.shape), []).append((weight, bias))
    by_shape = {shape: streaming_sample(group) for shape, group in by_shape.items()}
    by_shape = {shape: group for shape, group in by_shape.items() if packed.packed(group[0][0]) is not None}
    for group in by_shape.values():
        for weight, _ in group:
            packed.packed(weight)
    g = torch.Generator().manual_seed(0)  # a private stream: measuring must not move a user's seeded sampling
    plans, formats = {}, {}
    with log.progress(len(by_shape) * len(sizes), "CPU kernel plan") if progress else contextlib.nullcontext() as bar:
        for shape, group in by_shape.items():
            plans[shape], kind = _shape_plan(group, packed, sizes, repeats, g, bar)
            if kind == STREAMED:
                formats[shape] = STREAMED
    return KernelPlan(plans, formats)


def streaming_sample(group: list, min_bytes: int = SAMPLE_BYTES) -> list:
    """Evenly spaced weights of one shape's `group` that hold at least `min_bytes` (all where they hold
    less): timed in turn, they stream from memory as the whole group does in a forward, and each kernel's
    speed on a weight does not depend on which weight of the shape it is."""
    weight = group[0][0]
    count = min(len(group), -(-min_bytes // (weight.numel() * weight.element_size())))
    return [group[i * len(group) // count] for i in range(count)]


def _shape_plan(group, packed: PackedLinear, sizes, repeats: int, g: torch.Generator, bar) -> tuple[RowPlan, str]:
    """`measure_kernel_plan` for the (weight, bias) pairs of one shape: their row plan and packed format.
    `bar`: a progress bar stepped once per row count, or None."""
    streams = streamed_linear.available()
    panels = {id(w): streamed_linear.pack(w) for w, _ in group} if streams else {}  # freed on return

    def on_panels(x, weight, bias):
        return streamed_linear.linear(x, panels[id(weight)], weight.shape[0], bias)

    times: dict[str, list[float]] = {"blas": [], ONEDNN: [], STREAMED: []}
    for n in sizes:
        x = torch.randn(n, group[0][0].shape[1], generator=g)
        kernels = {"blas": torch.nn.functional.linear, ONEDNN: packed.apply}
        if streams and n <= STREAMED_MAX_ROWS:
            kernels[STREAMED] = on_panels
        runs = [{k: _linear_pass(group, x, f) for k, f in kernels.items()} for _ in range(repeats + 1)][1:]
        for k in times:  # the first pass above warmed up
            times[k].append(sorted(r[k] for r in runs)[len(runs) // 2] if k in kernels else float("inf"))
        if bar is not None:
            bar.update(1)
    kind = STREAMED if streams and _saving(times, STREAMED, sizes) > _saving(times, ONEDNN, sizes) else ONEDNN
    return RowPlan(tuple(sizes), tuple(t < PACKED_MARGIN * b for t, b in zip(times[kind], times["blas"]))), kind


def _saving(times: dict[str, list[float]], kind: str, sizes, most_rows: int = 16) -> float:
    """What `kind` saves over BLAS at the row counts of decoding (at most `most_rows`), summed as shares."""
    return sum(max(0.0, 1 - t / blas) for n, t, blas in zip(sizes, times[kind], times["blas"]) if n <= most_rows)


def _linear_pass(weights: list[tuple[torch.Tensor, torch.Tensor | None]], x: torch.Tensor, linear) -> float:
    """Seconds to run every (weight, bias) once on `x`, `linear(x, weight, bias)` being the kernel."""
    t0 = time.perf_counter()
    for weight, bias in weights:
        linear(x, weight, bias)
    return time.perf_counter() - t0


def kernel_plan_key(model) -> dict:
    """What a kernel plan depends on: the model's architecture and the machine (`cache.machine_key`)."""
    kernels = ["blas", ONEDNN, *([f"{STREAMED} {streamed_linear.version()}"] if streamed_linear.available() else [])]
    return {**machine_key(model), "sizes": list(KERNEL_PLAN_SIZES), "by": "weight shape", "kernels": kernels}


def cached_kernel_plan(
    model, refresh: bool = False, extra_weights: tuple[torch.Tensor, ...] = (), weights: str | None = None
) -> tuple[KernelPlan, Path, bool]:
    """`model`'s kernel plan on this machine (`extra_weights`: see `measure_kernel_plan`; their shapes
    must follow from the model's config, which keys the cache), measured once and then read from hf_bpd's cache
    (`cache.cache_root()/kernel_plan/`, keyed as forward-cost curves are; `weights` names weights of another
    precision than the config implies, such as a drafter's `compact_weights`, which the kernels run at
    other speeds). Returns (plan, cache file, whether it was measured now)."""
    key = kernel_plan_key(model) | ({"weights": weights} if weights is not None else {})
    path = cache_file("kernel_plan", key)

    def measure() -> dict:
        plan = measure_kernel_plan(model, extra_weights=extra_weights, progress=True)
        shapes = [[o, i, list(row.packed), plan.format((o, i))] for (o, i), row in plan.shapes.items()]
        extra = sorted({tuple(w.shape) for w in extra_weights})  # measured, whether the plan packs them or not
        return {"sizes": list(KERNEL_PLAN_SIZES), "shapes": shapes, "extra_shapes": [list(e) for e in extra]}

    def parse(record: dict) -> KernelPlan:
        sizes = tuple(record["sizes"])
        shapes = {(o, i): RowPlan(sizes, tuple(packed)) for o, i, packed, _ in record["shapes"]}
        formats = {(o, i): kind for o, i, _, kind in record["shapes"] if kind != ONEDNN}
        return KernelPlan(shapes, formats)

    what = f"the CPU kernel plan of {type(model).__name__}"
    record, measured = measured_once(path, key, measure, what, refresh)
    try:
        plan = parse(record)
    except (KeyError, TypeError, ValueError):  # a record of another format: measured again
        plan = None
    if plan is not None:
        # a record measured without these extra weights (a shape it neither planned nor measured): measured again
        covered = set(plan.shapes) | {tuple(e) for e in record.get("extra_shapes", ())}
        if measured or all(tuple(w.shape) in covered for w in extra_weights):
            return plan, path, measured
    record, measured = measured_once(path, key, measure, what, refresh=True)
    return parse(record), path, measured


def active_packed_linear() -> PackedLinear | None:
    """The innermost `PackedLinear` block open in this thread, for linears that are not `nn.Linear`
    layers (the heads' softmax over the base LM head's rows): `packed.apply(x, weight)`."""
    stack = _active()
    return stack[-1] if stack else None


def packed_or_plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for a weight that is no `nn.Linear` layer's, on the packed kernels of the
    innermost open block (`active_packed_linear`) where there is one."""
    packed = active_packed_linear()
    return packed.apply(x, weight, bias) if packed is not None else F.linear(x, weight, bias)


def _active() -> list[PackedLinear]:
    if not hasattr(_THREAD, "stack"):
        _THREAD.stack = []
    return _THREAD.stack


def wants_packed_linear(model, packed_linear: bool | None) -> bool:
    """Resolve a `packed_linear` setting for `model`: True/False as given (True raises where it cannot
    work), None ("auto") packs float32 CPU models of at most `AUTO_MAX_BYTES` when oneDNN is there and
    `model.forward` is not compiled (`compiled_forward`)."""
    param = next(model.parameters())
    servable = param.device.type == "cpu" and param.dtype == torch.float32
    compiled = compiled_forward(model)
    if packed_linear and compiled:
        raise ValueError(
            "model.forward is compiled (torch.compile), whose graph packs its own weights: packed linears "
            "cannot run under it; leave packed_linear unset (auto) or pass False"
        )
    if packed_linear is None:
        size = sum(p.numel() * p.element_size() for p in model.parameters())
        return servable and packed_linear_available() and size <= AUTO_MAX_BYTES and not compiled
    if packed_linear and not servable:
        raise ValueError(
            f"packed_linear=True serves float32 models on a CPU; this one is {param.dtype} on {param.device}"
        )
    if packed_linear and not packed_linear_available():
        raise RuntimeError("packed_linear=True needs oneDNN's packed linear ops, which this torch build lacks")
    return bool(packed_linear)


def linear_context(model, packed_linear: bool | None) -> contextlib.AbstractContextManager:
    """The context hf_bpd's decode runs in: `model`'s shared `PackedLinear`, or a no-op when
    `packed_linear` resolves to False (`wants_packed_linear`)."""
    if not wants_packed_linear(model, packed_linear):
        return contextlib.nullcontext()
    return _shared(model)


def _shared(model) -> PackedLinear:
    """`model`'s one `PackedLinear`, with the kernel plan measured on this machine (`cached_kernel_plan`:
    once per machine and model, then read from hf_bpd's cache) and `grouped_attention` for its layers."""
    mode = _MODES.get(model)
    if mode is None:
        mode = _MODES[model] = PackedLinear(model, plan=cached_kernel_plan(model)[0], grouped_attention_of=model)
    return mode


def fast_cpu(model: torch.nn.Module) -> PackedLinear:
    """Fast CPU kernels for any `generate` call (or any forward) on `model`, inside a `with` block:

        with hf_bpd.fast_cpu(model):
            model.generate(**inputs, max_new_tokens=128)  # greedy, sampling, beams, prompt lookup ...

    Every float32 `nn.Linear` of `model` runs the fastest of BLAS, oneDNN on a packed copy of its weight
    and `streamed_linear`'s panels (on AVX2 and AVX-512 CPUs) for its shape and row count, one row and the
    prefill included, as measured on this machine and model at first use (`.plan`; cached in hf_bpd's cache,
    so later processes read it; module docstring), and its
    `sdpa` attention layers run masked forwards of several tokens without copying the cache per query
    head (`grouped_attention`), and freed host memory stays with malloc for the next layer's activations
    instead of being mapped and faulted in again (`host_memory.reuse_freed_memory`, process-wide while a
    block is open; the freed heap is handed back when the last block closes). Assisted generation with a
    draft model: open a block for each, `with fast_cpu(model), fast_cpu(assistant_model):`.
    Returns `model`'s shared `PackedLinear` (the one hf_bpd's drafter uses too, so there is one packed
    copy per model): `.packed_bytes` is its memory, `.clear()` frees it. Raises, before any packing, for a
    model that is not float32 on a CPU or a torch build without oneDNN's packed ops."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"fast_cpu takes a torch model (nn.Module), got {type(model).__name__}")
    wants_packed_linear(model, True)  # raises with the reason where it cannot work
    return _shared(model)
