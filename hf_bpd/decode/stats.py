"""`DecodingStats`: what one `generate` call did, step by step and phase by phase (every decoding loop
records into the drafter's)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DecodingStats:
    """What one `generate` call did. `steps` counts base-model forwards after prefill (one per tree);
    `accepted_lengths[i]` is the number of tokens step i added (accepted drafts + the base model's own
    token). Times are seconds summed over steps, per phase."""

    steps: int = 0
    new_tokens: int = 0
    accepted_lengths: list[int] = field(default_factory=list)
    tree_sizes: list[int] = field(default_factory=list)
    plain_steps: int = 0  # steps that verified the roots alone, drafting nothing (`cost.StepChooser`)
    time_prefill: float = 0.0
    time_heads: float = 0.0
    time_rescore: float = 0.0
    time_tree: float = 0.0
    time_verify: float = 0.0
    time_accept: float = 0.0
    time_cache: float = 0.0
    time_warm_up: float = 0.0  # the captured step: graphs compiled before the first step (`CapturedDecoder.warm_up`)
    rows: list[DecodingStats] = field(default_factory=list)  # batches: each row's own steps and tokens
    host_syncs: dict[str, int] = field(default_factory=dict)  # by phase, when counted (count_host_syncs)
    replayed: int = 0  # tokens re-read after a recurrent state was restored (`recurrent.py`)

    @property
    def forwards(self) -> int:
        """Base-model forward passes, prefill included (plain greedy decoding: one per new token)."""
        return self.steps + 1

    @property
    def block_efficiency(self) -> float:
        """tau = new tokens / base-model forwards (prefill included): exactly 1.0 for plain decoding,
        up to h + 1 with h heads."""
        return self.new_tokens / self.forwards if self.new_tokens else 0.0

    @property
    def mean_accepted(self) -> float:
        """Mean tokens per verification step (excludes the prefill's token)."""
        return sum(self.accepted_lengths) / len(self.accepted_lengths) if self.accepted_lengths else 0.0

    def record_step(self, drafted: bool, new: int, nodes: int) -> None:
        """One step of a decoding loop: whether it drafted, the `new` tokens it added and the tree `nodes` it
        verified (over all rows of a batch). The step clock books its phases' times (`call.StepClock`)."""
        self.steps += 1
        self.plain_steps += not drafted
        self.new_tokens += new
        self.accepted_lengths.append(new)
        self.tree_sizes.append(nodes)

    def host_syncs_per_step(self) -> dict[str, float]:
        """Device-to-host synchronisations per decoding step, by phase (the prefill's are per call), when
        the drafter counted them (`BlockDrafter.count_host_syncs`; `syncs.py`)."""
        n = max(self.steps, 1)
        return {k: v if k == "prefill" else v / n for k, v in self.host_syncs.items()}

    def time_per_step(self) -> dict[str, float]:
        n = max(self.steps, 1)
        return {
            "heads": self.time_heads / n,
            "rescore": self.time_rescore / n,
            "lattice_tree": self.time_tree / n,
            "verify_forward": self.time_verify / n,
            "accept": self.time_accept / n,
            "cache_compaction": self.time_cache / n,
        }
