"""Tree size from the hardware.

The base model's verification cost depends on the number of tree tokens N, and how depends on the device:
on the dev CPU (MKL on AMD) one token costs 66 ms but two cost 100-127 ms (GEMV vs small-M GEMM), then the
curve is nearly flat up to 16; with oneDNN pre-packed weights (`packed_linear`) two to eight tokens cost
70-95 ms; on a GPU the curve is flat far longer. `ForwardCost` holds that curve (measured by
`measure_forward_cost`), and `best_tree_size` picks, per step, the N that maximises expected accepted
tokens per second: (1 + sum of the first N-1 nodes' probabilities) / cost(N).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from dataclasses import dataclass

import torch

from .packed_linear import linear_context
from .vocab import model_vocab_size

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
        if i == 0:
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
    model, sizes=DEFAULT_SIZES, context: int = 256, repeats: int = 3, packed_linear: bool | None = None
) -> ForwardCost:
    """Median time of a forward of N tokens on a `context`-token cache, with the tree-style 4D mask, run
    the way verification runs it (`packed_linear`: as the drafter's setting)."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    vocab = model_vocab_size(model)
    packed = linear_context(model, packed_linear)  # resolved once, outside the timed forwards
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.randint(0, vocab, (1, context), device=device), past_key_values=cache, use_cache=True)
    times = []
    for n in sizes:
        ids = torch.randint(0, vocab, (1, n), device=device)
        mask = torch.zeros(1, 1, n, context + n, dtype=dtype, device=device)
        pos = torch.arange(context, context + n, device=device)[None]
        runs = []
        for _ in range(repeats + 1):  # first run warms up
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            with packed:
                model(
                    input_ids=ids,
                    attention_mask=mask,
                    position_ids=pos,
                    past_key_values=cache,
                    use_cache=True,
                    output_hidden_states=True,
                )
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            runs.append(time.perf_counter() - t0)
            cache.crop(-n)
        times.append(sorted(runs[1:])[len(runs[1:]) // 2])
    return ForwardCost(tuple(sizes), tuple(times))


class LearnedForwardCost:
    """A measured `ForwardCost` curve, corrected by the verification forwards actually timed in decoding.

    The start-up curve is taken on a short random context with warm caches; in decoding the context is
    longer and the drafting work between forwards evicts the weights from the CPU caches, so on the dev
    CPU a 16-token tree cost 2.1-2.5 single-token steps in place against 2.0 in the start-up measurement.
    Each size bucket of the curve (the smallest measured size >= N) keeps a running mean of measured /
    curve time (`rate`: weight of the newest forward); a bucket never timed takes the running mean over
    all timed forwards (the machine's drift), so the ratio between sizes stays the curve's until measured.
    """

    def __init__(self, curve: ForwardCost, rate: float = 0.1) -> None:
        if not 0 < rate <= 1:
            raise ValueError(f"rate must be in (0, 1], got {rate}")
        self.curve = curve
        self.rate = rate
        self.factors: dict[int, float] = {}
        self.overall: float | None = None

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
        self.factors[bucket] = _running_mean(self.factors.get(bucket), ratio, self.rate)
        self.overall = _running_mean(self.overall, ratio, self.rate)


def _running_mean(old: float | None, new: float, rate: float) -> float:
    return new if old is None else old + rate * (new - old)


def best_tree_size(node_probs: list[float], cost: ForwardCost | LearnedForwardCost) -> int:
    """node_probs[i]: probability that tree node i (insertion order, root first, root = 1) is accepted.
    Returns the N maximising (sum of the first N probabilities) / cost(N)."""
    best_n, best_rate, expected = 1, 0.0, 0.0
    for n, p in enumerate(node_probs, start=1):
        expected += p
        rate = expected / cost(n)
        if rate > best_rate:
            best_n, best_rate = n, rate
    return best_n
