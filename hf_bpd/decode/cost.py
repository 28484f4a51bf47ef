"""Tree size and CPU kernels from the hardware.

The base model's verification cost depends on the number of tree tokens N, and how depends on the device:
on a CPU a forward of a few tokens can cost far more than one (matrix-vector against small-matrix
kernels), on a GPU the curve is flat far longer. `ForwardCost` holds that curve (measured by
`measure_forward_cost`), and `best_tree_size` (the drafter's: `drafting/assembly.py`) picks, per step, the
N that maximises expected accepted tokens per second: (1 + sum of the first N-1 nodes' probabilities) /
cost(N).

Which CPU kernel runs the forwards, BLAS or oneDNN with pre-packed weights, is measured apart
(`packed_linear.cached_kernel_plan`). RESULTS.md has the measured curves of the machines the project ran on.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from statistics import median_high

import torch

from .. import log
from ..compat import cache_argument, compiled_forward
from ..cpu import streamed_linear
from ..cpu.packed_linear import linear_context, wants_packed_linear
from ..disk_cache import cache_root, key_file_name, machine_key, measured_once
from ..drafting.assembly import best_batch_width as best_batch_width  # sizing trees is the drafter's
from ..drafting.assembly import best_tree_size as best_tree_size
from ..drafting.tree import DraftTree, batch_trees
from ..drafting.vocab import model_vocab_size
from ..kv import contiguous_kv, drop_last, grow_layers, restore, snapshot, state_tensors
from .verify import verify_chain, verify_tree

DEFAULT_SIZES = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class ForwardCost:
    """Seconds of one base-model forward of N tokens, at measured sizes; linear in between."""

    sizes: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.seconds) or not self.sizes or list(self.sizes) != sorted(self.sizes):
            raise ValueError("ForwardCost needs increasing sizes with one time each")

    def __call__(self, n: int) -> float:
        i = bisect_left(self.sizes, n)
        if i < len(self.sizes) and self.sizes[i] == n:
            return self.seconds[i]
        if i == 0 or len(self.sizes) == 1:  # below the curve, or one size measured: no slope to follow
            return self.seconds[0]
        if i == len(self.sizes):  # extrapolate with the last slope
            i -= 1
        (a, b), (ta, tb) = self.sizes[i - 1 : i + 1], self.seconds[i - 1 : i + 1]
        return ta + (tb - ta) * (n - a) / (b - a)

    @property
    def max_size(self) -> int:
        return self.sizes[-1]


@torch.no_grad()
def measure_forward_cost(
    model,
    sizes=DEFAULT_SIZES,
    context: int = 256,
    repeats: int = 3,
    packed_linear: bool | None = None,
    progress: bool = False,
) -> ForwardCost:
    """Median time of a forward of N tokens on a `context`-token cache, with the tree-style 4D mask, run
    the way verification runs it (`packed_linear`: as the drafter's setting), fitted non-decreasing in N.

    The sizes are timed in rounds (every size once per round, a first round to warm up) rather than one
    size's repeats in a row, so a burst of load elsewhere on the machine lands on every size alike instead
    of making one size look cheap or dear. A wider forward does the narrower one's work and more, so a
    curve where 4 tokens cost less than 1 is noise; left in, it would size trees as if width were free.
    The medians are therefore fitted by isotonic regression (`isotonic`). A burst can also make one size
    dear, a peak above its neighbours' chord (`peaks`): those sizes and their neighbours are timed again in
    as many rounds, and each keeps the lower of its two medians, since load only ever slows a forward. A
    shape the machine really has comes back the same. `progress`: draw a bar (`log.progress`)."""
    packed = linear_context(model, packed_linear)  # resolved once, outside the timed forwards
    timer = ForwardTimer(model, context)

    def time_once(n: int) -> float:
        return timer.once(n, packed)

    with log.progress((repeats + 1) * len(sizes), "forward-cost curve") if progress else nullcontext() as bar:
        medians = timed_medians(time_once, sizes, repeats, warm_up=True, bar=bar)
    again = sorted({sizes[j] for i in peaks(sizes, isotonic(medians)) for j in (i - 1, i, i + 1)})
    if again:
        retimed = dict(zip(again, timed_medians(time_once, again, repeats)))
        medians = [min(m, retimed.get(n, m)) for n, m in zip(sizes, medians)]
    return ForwardCost(tuple(sizes), tuple(isotonic(medians)))


def timed_medians(time_once: Callable[[int], float], sizes, repeats: int, warm_up: bool = False, bar=None):
    """Per size, the median of `repeats` timings (`time_once(n)`) taken in rounds over all sizes, after a
    round to warm up where `warm_up`."""
    runs = []
    for _ in range(repeats + int(warm_up)):
        runs.append([time_once(n) for n in sizes])
        if bar is not None:
            bar.update(len(sizes))
    return [median_high(by_size) for by_size in zip(*runs[int(warm_up) :])]


PEAK = 0.15  # above its neighbours' chord by more than this: timed again


def peaks(sizes, seconds, above: float = PEAK) -> list[int]:
    """Indices of the inner points of a curve more than `above` (a fraction) above the chord between their
    neighbours."""
    found = []
    for i in range(1, len(sizes) - 1):
        (a, n, b), (ta, t, tb) = sizes[i - 1 : i + 2], seconds[i - 1 : i + 2]
        if t > (1 + above) * (ta + (tb - ta) * (n - a) / (b - a)):
            found.append(i)
    return found


def isotonic(values: list[float]) -> list[float]:
    """The non-decreasing sequence closest to `values` in squared error (pool adjacent violators: a run
    that decreases is replaced by its mean, repeatedly)."""
    blocks: list[list[float]] = []  # [mean, count]
    for value in values:
        blocks.append([value, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (mean_a, count_a), (mean_b, count_b) = blocks[-2], blocks.pop()
            blocks[-1] = [(mean_a * count_a + mean_b * count_b) / (count_a + count_b), count_a + count_b]
    return [mean for mean, count in blocks for _ in range(int(count))]


class ForwardTimer:
    """Times forwards of N random tokens on a `context`-token cache (the cache is cropped back after each),
    each the very call verification makes (`verify.verify_tree` on a chain of N tokens: a compiled forward
    guards on its keyword arguments and on its inputs' views and strides, so these forwards compile the
    graphs decoding then runs), on a private random stream: measuring never moves a user's seeded
    sampling. A model with recurrent state is timed on the forward its decoding verifies, a chain
    (`verify.verify_chain`), and its cache is put back by a state snapshot, since such a state cannot be
    cropped. Its forwards run without autograd whatever the caller's grad mode, as `generate`'s do: with
    it, a forward records a graph and keeps its activations, and times nothing decoding runs."""

    def __init__(self, model, context: int) -> None:
        from transformers import DynamicCache

        self.model = model
        self.device = next(model.parameters()).device
        self.vocab = model_vocab_size(model)
        self.context = context
        self.cache = DynamicCache(config=model.config)
        if not compiled_forward(model):  # as decoding's cache (`call.prefill`)
            grow_layers(self.cache)
        self.generator = torch.Generator().manual_seed(0)
        self.cache_kwarg = cache_argument(model)
        prompt = torch.randint(0, self.vocab, (1, context), generator=self.generator).to(self.device)
        with torch.no_grad():
            model(input_ids=prompt, **{self.cache_kwarg: self.cache}, use_cache=True)
        self.stateful = bool(state_tensors(self.cache))
        # laid out as decoding lays out a compiled forward's cache, so the graphs compiled here serve it
        self.contiguous = compiled_forward(model)
        if self.contiguous:
            contiguous_kv(self.cache)
        self.past_mask = torch.ones(1, context, device=self.device)

    @torch.no_grad()
    def once(self, n: int, block) -> float:
        ids = torch.randint(0, self.vocab, (1, n), generator=self.generator).to(self.device)
        saved = snapshot(self.cache) if self.stateful else None
        # N tokens as a tree of one path, built as decoding builds its trees (every tree of N nodes costs one
        # forward of N tokens); outside the timing, as decoding builds them in its draft phase
        if not self.stateful:
            chain = DraftTree.from_paths(int(ids[0, 0]), [ids[0, 1:].tolist()], max_nodes=n)
            tree = batch_trees([chain], pad_token_id=0, device=self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        with block:
            if self.stateful:
                verify_chain(self.model, ids, self.cache, self.past_mask)
            else:  # the very call decoding makes: a compiled forward guards on its inputs, views included
                verify_tree(self.model, tree, self.cache, self.past_mask)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        if self.stateful:
            restore(self.cache, saved)
            drop_last(self.cache, n)
        else:
            self.cache.crop(-n)
        if self.contiguous:
            contiguous_kv(self.cache)
        return seconds

    def median(self, n: int, block, repeats: int) -> float:
        runs = [self.once(n, block) for _ in range(repeats + 1)][1:]  # the first run warms up
        return median_high(runs)


def forward_cost_key(model, packed_linear: bool | None = None, sizes=DEFAULT_SIZES, context: int = 256) -> dict:
    """Everything a measured curve depends on: the model's architecture and machine (`cache.machine_key`)
    and the verification setting (packed linears)."""
    return {
        **machine_key(model),
        "packed_linear": wants_packed_linear(model, packed_linear),
        "compiled_forward": compiled_forward(model),
        # curves from before the measured kernel plan, from before it could choose the streamed kernel, and from
        # another version of that kernel are measured again
        "kernels": f"plan with streamed_linear {streamed_linear.version()}",
        "timed_as": "verify_tree",  # and those from before the timing made decoding's own call
        "cache": "grown in place",  # and those timed on a cache that copied itself every forward
        "fit": "isotonic, rounds, peaks timed again",  # and those fitted otherwise
        "sizes": list(sizes),
        "context": context,
    }


def forward_cost_dir() -> Path:
    """Where measured curves are kept: `forward_cost/` in hf_bpd's cache (`cache.cache_root`)."""

    return cache_root() / "forward_cost"


def forward_cost_cache_file(key: dict) -> Path:
    return forward_cost_dir() / key_file_name(key)


def cached_forward_cost(
    model, packed_linear: bool | None = None, sizes=DEFAULT_SIZES, refresh: bool = False
) -> tuple[ForwardCost, Path, bool]:
    """The forward-cost curve of `model` on this machine, measured once and then read from hf_bpd's cache
    (`cache.cache_root()/forward_cost/`), keyed by `forward_cost_key`. Returns (curve, cache file,
    whether it was measured now). Only tree sizes depend on it, never a token; the drafter's
    `LearnedForwardCost` corrects it online with the forwards it times, and drops it from the cache where
    they contradict it (`binding.ModelBinding.review_forward_cost`). A curve measured on a busy machine is
    measured again (`cache.measured_once`); `refresh` measures again."""
    key = forward_cost_key(model, packed_linear, sizes)
    path = forward_cost_cache_file(key)

    def measure() -> dict:
        curve = measure_forward_cost(model, sizes, packed_linear=packed_linear, progress=True)
        return {"sizes": list(curve.sizes), "seconds": list(curve.seconds)}

    what = f"the forward-cost curve of {type(model).__name__}"
    record, measured = measured_once(path, key, measure, what, refresh)
    try:
        curve = ForwardCost(tuple(record["sizes"]), tuple(record["seconds"]))
    except (KeyError, TypeError, ValueError):  # a record of another format: measured again
        record, measured = measured_once(path, key, measure, what, refresh=True)
        curve = ForwardCost(tuple(record["sizes"]), tuple(record["seconds"]))
    return curve, path, measured


class LearnedForwardCost:
    """A measured `ForwardCost` curve, corrected by the verification forwards actually timed in decoding.

    The start-up curve is taken on a short random context with warm caches; in decoding the context is
    longer and the drafting work between forwards evicts the weights from the CPU caches, so on the dev
    CPU a 16-token tree cost 2.1-2.5 single-token steps in place against 2.0 in the start-up measurement.
    Each size bucket of the curve (the smallest measured size >= N) keeps a running mean of measured /
    curve time (`rate`: weight of the newest forward); a bucket never timed takes the running mean over
    all timed forwards (the machine's drift), so the ratio between sizes stays the curve's until measured.

    A bucket that is no longer timed drifts back to that overall mean (`stale_rate` per timed forward of
    another size): without it, trees timed during a burst of load elsewhere on the machine would look
    expensive for good, the drafter would verify only single tokens, and those never time a tree again.
    """

    def __init__(self, curve: ForwardCost, rate: float = 0.1, stale_rate: float = 0.02) -> None:
        if not 0 < rate <= 1:
            raise ValueError(f"rate must be in (0, 1], got {rate}")
        if not 0 <= stale_rate < 1:
            raise ValueError(f"stale_rate must be in [0, 1), got {stale_rate}")
        self.curve = curve
        self.rate = rate
        self.stale_rate = stale_rate
        self.factors: dict[int, float] = {}
        self.overall: float | None = None
        self.timed: dict[int, int] = {}  # forwards timed per bucket

    def disagreement(self, min_timed: int = 3) -> float:
        """How far decoding's timed forwards put the curve off, as a factor >= 1: the largest of each
        bucket's factor or its inverse, over buckets timed at least `min_timed` times (1.0: none were)."""
        factors = [f for b, f in self.factors.items() if self.timed.get(b, 0) >= min_timed]
        return max((max(f, 1 / f) for f in factors), default=1.0)

    def _bucket(self, n: int) -> int:
        i = bisect_left(self.curve.sizes, n)
        return self.curve.sizes[min(i, len(self.curve.sizes) - 1)]

    def __call__(self, n: int) -> float:
        return self.curve(n) * self.factors.get(self._bucket(n), self.overall or 1.0)

    @property
    def max_size(self) -> int:
        return self.curve.max_size

    def observe(self, n: int, seconds: float) -> None:
        """One timed verification forward of `n` tree tokens."""
        bucket, ratio = self._bucket(n), seconds / self.curve(n)
        self.timed[bucket] = self.timed.get(bucket, 0) + 1
        self.factors[bucket] = running_mean(self.factors.get(bucket), ratio, self.rate)
        self.overall = running_mean(self.overall, ratio, self.rate)
        for other in self.factors:
            if other != bucket:
                self.factors[other] = running_mean(self.factors[other], self.overall, self.stale_rate)


def running_mean(old: float | None, new: float, rate: float) -> float:
    return new if old is None else old + rate * (new - old)


def speedup_bound(tau: float, one_token_seconds: float, step_seconds: float) -> float:
    """Speedup over plain decoding of a method that yields `tau` tokens per step of `step_seconds`, where
    plain decoding pays `one_token_seconds` per token: with step = t(n) alone, the zero-overhead limit of a
    tree of n tokens; with step = t(n) + drafting, what such a drafter can reach."""
    return tau * one_token_seconds / step_seconds


class BatchForwardCost:
    """Seconds of one batch verification forward of `rows` rows by tree width, for one `generate` call.

    The start-up curve is measured on one row at a short context. A batch's forward at its own contexts
    (often far longer) costs more, and not in proportion: attention grows with rows x width x context while
    the curve sees mostly the linear layers. So the call times its own forwards (`observe`): each width it
    verified keeps a running mean of its seconds, and a width not yet timed is estimated from the nearest
    timed one, scaled by the curve's ratio between the two. `batch.decode_batch` verifies roots only in its
    first step, so the plain one-token step is always among the timed widths.
    """

    def __init__(self, curve: ForwardCost | LearnedForwardCost, rows: int, rate: float = 0.3) -> None:
        self.curve = curve
        self.rows = rows
        self.rate = rate
        self.seconds: dict[int, float] = {}
        # the share by which a drafted width must out-yield the roots alone (`best_batch_width`); the batch
        # loop sets it each step for the rows left (`batch.batch_draft_margin`)
        self.margin = 0.0

    def __call__(self, n: int) -> float:
        """Seconds of a forward of n = rows x width tokens."""
        width = max(1, -(-n // self.rows))
        if width in self.seconds:
            return self.seconds[width]
        if not self.seconds:
            return self.curve(n)
        near = min(self.seconds, key=lambda w: abs(math.log(w / width)))
        return self.seconds[near] * self.curve(self.rows * width) / self.curve(self.rows * near)

    def max_width(self) -> int:
        """The widest trees worth verifying next: twice the widest width timed. An untimed width's cost is
        extrapolated through the one-row curve, which underestimates a batch's wide forwards at long
        contexts (attention), so a first guess could verify a forward several plain steps long that yields
        little; ramping up 2, 4, 8 ... bounds what a wrong guess costs to about twice a timed forward."""
        return 2 * max(self.seconds, default=1)

    def observe(self, width: int, seconds: float) -> None:
        """One timed verification forward of the batch, its trees padded to `width`."""
        self.seconds[width] = running_mean(self.seconds.get(width), seconds, self.rate)


# (plain steps before drafting is probed again, the longest that wait doubles to): one row's drafted probe costs
# little more than a plain step where drafts are weak (its tree is sized down to a node or two), while a long
# plain streak misses the text drafting pays on; a batch's drafted probe costs several plain steps (every row's
# heads, a wide forward), so a batch waits longer
ROW_PROBES = (4, 8)
BATCH_PROBES = (8, 32)


@dataclass
class StepChooser:
    """Drafted or plain steps, by measured throughput: a drafted step pays for the heads, the tree and the
    acceptance walk on top of a wider forward, and where drafts are rarely accepted (or a batch's forward
    is compute-bound) that costs more than it returns. So each `generate` call measures what its drafted
    steps yield, tokens per second of the whole step, and takes plain steps (the roots only: no heads, no
    tree, a one-token forward per row) while those are faster; after `probe_every` plain steps a drafted
    step checks again. Each probe that finds drafting still slower doubles the wait before the next one (up
    to `max_probe_every`), and a probe that finds it faster resets it: where drafts do not pay (a large
    batch, unpredictable text) a probe costs several plain steps, so probing at a fixed rate would keep a
    fixed share of that loss. Only the speed depends on it, never a token.

    A plain step's seconds are measured once plain steps ran; before that `plain_estimate()` stands in
    (for one row the forward-cost curve's one-token time, learned online; for a batch its own timed
    one-token forward, `BatchForwardCost`; None: unknown, so draft). A call's first plain step (a batch
    starts with one) pays for first-call work at the new shape, so its time is provisional: once drafted
    steps were timed, one more plain step is taken and its time replaces it. Otherwise a slow first
    measurement would keep the chooser drafting, and drafting never measures the plain step again.

    `margin`: drafting must yield that share more tokens per second than plain steps to be taken. Where
    drafted and plain steps are close, each running mean rests on few, noisy step times, so drafting on
    a measured gain of a few per cent is as likely to lose as to win; a margin keeps those steps plain.

    The probes go both ways where the two are close: while drafting wins by less than `close` (a share on
    top of the margin), a plain step measures plain steps again after `probe_every` drafted ones (the wait
    doubling to `max_probe_every` while drafting keeps winning). Otherwise one slow plain time (a busy
    host, a step that paid for a squeeze) keeps a call drafting at a loss to its end, since drafted steps
    never time a plain one. A clear win is not probed: a plain step there costs what drafting gains.

    One row's drafted step is judged by its tree's expected tokens where the drafter knows them (calibrated
    node probabilities: `BlockDrafter.expected_tokens`), not by the tokens it happened to add. Those run
    from 1 to a whole path, so a call judged on them turned to plain steps after one or two misses, and each
    probe, one step judged alone, kept it there by chance: where drafting paid, a call took from a few to
    most of its steps plain, run to run. The expectation learns from the accepted tokens through the
    calibration (every verified node), and follows the text through the heads' own confidence. A batch
    step's tokens are a sum over its rows, where one row's luck weighs less: batches pass no expectation.

    `charge_drafting`: seconds that drafted steps caused but a later step paid (a batch's squeeze of the
    holes its rows' different acceptances left, `kv.HoleLedger`): added to the next drafted step's
    time, so they count against drafting and not against the plain step that happened to pay them."""

    plain_estimate: Callable[[], float | None]
    probe_every: int = BATCH_PROBES[0]
    max_probe_every: int = BATCH_PROBES[1]
    rate: float = 0.3  # weight of the newest step in the running means
    drafted_rate: float | None = None  # tokens per second of drafted steps
    plain_step_seconds: float | None = None  # seconds of a plain step, measured
    plain_run: int = 0  # plain steps since the last drafted one
    plain_taken: int = 0  # plain steps in all
    plain_timed: int = 0  # plain steps measured
    probe_wait: int | None = None  # plain steps before the next probe (from probe_every, doubled per failed probe)
    margin: float = 0.0  # the share by which drafted steps must out-yield plain ones to be taken
    close: float = 0.25  # a drafting win below this share (on top of the margin) has plain steps probed too
    drafted_run: int = 0  # drafted steps since the last plain one
    plain_probe_wait: int | None = None  # drafted steps before plain steps are measured again
    pending_charge: float = 0.0  # seconds owed by drafting, added to the next drafted step (`charge_drafting`)

    def draft_next(self, rows: int = 1) -> bool:
        """Whether the next step drafts, for `rows` unfinished rows (a plain step makes one token each)."""
        plain = self.plain_step_seconds if self.plain_step_seconds is not None else self.plain_estimate()
        if self.plain_timed == 1 and self.drafted_rate is not None and self.plain_run == 0:
            self.plain_run += 1  # the provisional first plain time, measured again (class docstring)
            self.plain_taken += 1
            return False
        if self.drafted_rate is None or plain is None or self.drafted_rate >= (1 + self.margin) * rows / plain:
            self.probe_wait = self.probe_every  # drafting pays (again): probe soon if it stops paying
            wait = self.probe_every if self.plain_probe_wait is None else self.plain_probe_wait
            near = plain is not None and self.drafted_rate is not None
            near = near and self.drafted_rate < (1 + self.margin + self.close) * rows / plain
            if near and self.plain_timed > 0 and self.drafted_run >= wait:  # measure plain steps again
                self.plain_probe_wait = min(2 * wait, self.max_probe_every)
                self.plain_run += 1
                self.plain_taken += 1
                return False
            return True
        self.plain_probe_wait = None  # plain steps win: a later drafting streak probes them soon again
        wait = self.probe_every if self.probe_wait is None else self.probe_wait
        if self.plain_run >= wait:  # probe; if drafting still loses after it, the next probe waits twice as long
            self.probe_wait = min(2 * wait, self.max_probe_every)
            return True
        self.plain_run += 1
        self.plain_taken += 1
        return False

    def observe(self, drafted: bool, tokens: int, seconds: float, expected: float | None = None) -> None:
        """A step's new tokens (all rows) and its seconds, from drafting to the accepted tokens. `expected`:
        a drafted step's expected new tokens (`BlockDrafter.expected_tokens`), which then stands for its
        tokens (class docstring)."""
        if drafted:
            self.plain_run = 0
            self.drafted_run += 1
            seconds, self.pending_charge = seconds + self.pending_charge, 0.0
            gained = tokens if expected is None else expected
            self.drafted_rate = running_mean(self.drafted_rate, gained / max(seconds, 1e-9), self.rate)
        else:
            self.drafted_run = 0
            self.plain_timed += 1
            earlier = None if self.plain_timed == 2 else self.plain_step_seconds  # the second replaces the first
            self.plain_step_seconds = running_mean(earlier, seconds, self.rate)

    def charge_drafting(self, seconds: float) -> None:
        """Seconds drafted steps caused that another step paid (class docstring)."""
        self.pending_charge += seconds
