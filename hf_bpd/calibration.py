"""Online calibration of draft acceptance estimates.

Tree sizing (`cost.best_tree_size`) trades a bigger forward for more expected accepted tokens, so it is only
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
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

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
    accepted: dict[tuple[str, int], float] = field(default_factory=lambda: defaultdict(float))
    predicted: dict[tuple[str, int], float] = field(default_factory=lambda: defaultdict(float))

    def _key(self, source: str, depth: int) -> tuple[str, int]:
        return source, min(depth, self.max_depth)

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

    def summary(self) -> dict[str, float]:
        """{"source@depth": multiplier} for every key with evidence (for reports)."""
        return {f"{s}@{d}": self.scale(s, d) for s, d in sorted(self.predicted)}


def calibrated_logprob(arc: Arc, depth: int, calibration: AcceptanceCalibration | None) -> float:
    """The arc's log-probability as trees are ordered and sized: calibrated when there is a calibration."""
    return arc.logprob if calibration is None else calibration.calibrated(arc, depth)
