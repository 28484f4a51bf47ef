"""Online calibration of draft acceptance estimates.

Tree sizing (`assembly.best_tree_size`) trades a bigger forward for more expected accepted tokens, so it is only
as good as the estimates. Raw estimates are overconfident: a head's softmax is a marginal over contexts it
never saw conditioned on the drafted prefix, and a path's probability multiplies them as if they were
independent. With SmolLM2's shipped heads the learned multipliers come out near 0.3-0.5 (the heads' arcs
are accepted a third to half as often as they claim; `python -m research.ablate_calibration` prints them),
so trees sized on raw estimates were often a loss on a CPU where any multi-token forward costs about two
single-token ones.

`AcceptanceCalibration` learns, from the drafter's own verification results, one multiplier per (source,
depth) of an arc's conditional acceptance probability: among the children of every tree node the base
model reached, the sum of their estimated arc probabilities against how often one of them was accepted. A
ratio estimator with `prior` pseudo-observations starts at 1 (trust the estimates) and converges to the
measured rate. It only reorders and sizes drafts, never changes a verified token, so output stays exact.

Sampling changes what "accepted" means. Greedy accepts a child when it is the base model's argmax; exact
sampling (`accept.accept_tree`) accepts it when the base model's draw lands on it, with probability
p_warped(token): the base distribution after temperature and top-p. So when sampling, the heads'
estimates are warped the same way first (`SamplingWarp`: a sibling set that was a near tie gets shared
acceptance, a token outside the nucleus gets none), and the multipliers are learned per regime (greedy or
sampled), so one drafter can serve both kinds of calls without one corrupting the other's estimates.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch

GREEDY = "greedy"  # acceptance regimes: the base model's argmax, or its draw (`SamplingWarp`)
SAMPLED = "sampled"
HEADS = "heads"  # an arc whose best estimate is the heads' lattice probability
RESCORER = "rescorer"  # an arc whose best estimate came from the rescorer


@dataclass
class Arc:
    """A tree node's own arc: raw log-probability of its token given its parent, and where it came from."""

    logprob: float
    source: str


@dataclass
class AcceptanceCalibration:
    """Per (source, depth) multipliers of arc acceptance probabilities, learned online.

    prior:     pseudo-observations at the raw estimate (how much evidence it takes to move a multiplier).
    max_depth: depths beyond this share one multiplier (few observations there).
    """

    prior: float = 2.0
    max_depth: int = 4
    accepted: dict[tuple[str, str, int], float] = field(default_factory=lambda: defaultdict(float))
    predicted: dict[tuple[str, str, int], float] = field(default_factory=lambda: defaultdict(float))
    regime: str = GREEDY  # what the current call's acceptance means: GREEDY or SAMPLED (set per draft)

    def _key(self, source: str, depth: int) -> tuple[str, str, int]:
        return self.regime, source, min(depth, self.max_depth)

    def scale(self, source: str, depth: int) -> float:
        """Measured over estimated acceptance for arcs of this source at this depth (1 before evidence)."""
        key = self._key(source, depth)
        return (self.accepted.get(key, 0.0) + self.prior) / (self.predicted.get(key, 0.0) + self.prior)

    def calibrated(self, arc: Arc, depth: int) -> float:
        """The arc's calibrated log-probability (never above 0)."""
        return min(0.0, arc.logprob + math.log(self.scale(arc.source, depth)))

    def observe(self, arc: Arc, depth: int, accepted: bool) -> None:
        """One drafted arc whose parent the base model reached: estimated, and accepted or not. An arc
        without an estimate (a rescorer's draft that carries none) teaches nothing."""
        if arc.logprob == -math.inf:
            return
        key = self._key(arc.source, depth)
        self.predicted[key] += math.exp(arc.logprob)
        self.accepted[key] += float(accepted)

    def count_table(self, sources: tuple[str, ...], columns: int, regime: str = GREEDY) -> torch.Tensor:
        """[2, len(sources), columns] float32: the accepted and predicted sums of `regime`'s keys, row s for
        `sources[s]`, column d for depth key d (depths past `max_depth` share its column): the form a
        decoding step on the device learns in (`decode/captured.py`), read back with `load_count_table`."""
        table = torch.zeros(2, len(sources), columns)
        for s, source in enumerate(sources):
            for d in range(min(columns, self.max_depth + 1)):
                key = (regime, source, d)
                table[0, s, d], table[1, s, d] = self.accepted.get(key, 0.0), self.predicted.get(key, 0.0)
        return table

    def load_count_table(self, sources: tuple[str, ...], table: torch.Tensor, regime: str = GREEDY) -> None:
        """`count_table`'s sums, learned further elsewhere, taken back as this calibration's."""
        for s, source in enumerate(sources):
            for d in range(min(table.shape[2], self.max_depth + 1)):
                accepted, predicted = float(table[0, s, d]), float(table[1, s, d])
                if accepted or predicted:
                    self.accepted[(regime, source, d)], self.predicted[(regime, source, d)] = accepted, predicted

    def summary(self) -> dict[str, float]:
        """{"source@depth": multiplier} for every key with evidence (for reports); sampled calls' keys
        end in " sampled"."""
        out = {}
        for regime, source, depth in sorted(self.predicted):
            key = (regime, source, depth)
            rate = (self.accepted.get(key, 0.0) + self.prior) / (self.predicted[key] + self.prior)
            out[f"{source}@{depth}" + ("" if regime == GREEDY else f" {regime}")] = rate
        return out


def calibrated_logprob(arc: Arc, depth: int, calibration: AcceptanceCalibration | None) -> float:
    """The arc's log-probability as trees are ordered and sized: calibrated when there is a calibration.
    Never above 0, so no child's path outranks its parent's (a warped estimate can round to just above 0)."""
    return min(0.0, arc.logprob) if calibration is None else calibration.calibrated(arc, depth)


@dataclass(frozen=True)
class SamplingWarp:
    """What sampling does to the base model's distribution, applied to the heads' estimates of it: the
    temperature, then top-p (the warpers behind most sampled traffic; others are left to calibration).

    The heads give each node's top-k children only, so the normaliser is completed by bounding the rest
    of the vocabulary's mass (1 - the top-k's) as if every other token had the k-th's probability, and the
    nucleus that does not end inside the top-k is taken to hold `top_p` exactly. Estimates only: they order
    and size drafts, never choose a token."""

    temperature: float = 1.0
    top_p: float = 1.0

    @classmethod
    def from_config(cls, generation_config) -> SamplingWarp | None:
        """The warp of a `generate` call's config; None when it does not sample (greedy regime)."""
        if not generation_config.do_sample:
            return None
        temperature = generation_config.temperature
        top_p = generation_config.top_p
        return cls(1.0 if temperature is None else float(temperature), 1.0 if top_p is None else float(top_p))

    def __call__(self, logprobs: torch.Tensor) -> torch.Tensor:
        """`[n, k]` top-k log-probabilities of n nodes' children, each row sorted descending -> the
        warped ones (-inf outside the nucleus)."""
        logprobs = logprobs.float()
        if self.temperature != 1.0:
            probs = logprobs.exp()
            rest = (1.0 - probs.sum(-1, keepdim=True)).clamp_min(0.0)
            rest = rest * probs[:, -1:].clamp_min(1e-30) ** (1.0 / self.temperature - 1.0)
            scaled = logprobs / self.temperature
            logprobs = scaled - torch.logaddexp(scaled.logsumexp(-1, keepdim=True), rest.clamp_min(1e-30).log())
        if self.top_p < 1.0:
            probs = logprobs.exp()
            inside = probs.cumsum(-1) - probs < self.top_p
            nucleus = (probs * inside).sum(-1, keepdim=True).clamp_min(self.top_p)
            logprobs = torch.where(inside, logprobs - nucleus.log(), -math.inf)
        return logprobs
