"""What one `generate` call's decoding loop keeps, whichever loop it is: one row (`row.decode`), a batch
(`batch.decode_batch`) or chains of a model with recurrent state (`recurrent.decode_recurrent`).

The loops differ in how they verify (a tree, a batch of trees, a chain) and how they update the cache;
everything else is one call's business and lives here, once:

- the call's settings read from `generate`'s arguments: sampling or greedy, the sampling warp the heads'
  estimates follow, the stopping criteria's host form (`HostStop`), the per-token outputs asked for;
- the prefill and the first token, exactly as `generate` makes them;
- the drafter's binding to the model (`binding.ModelBinding`): the cost trees are sized by, the forwards
  timed to correct it, and the step chooser of cost-sized trees;
- the depth cap: trees are drafted within the positions the model serves (its text config's context,
  below a LongRoPE switch: `support.drafting_context`);
- the step clock: `with call.clock.phase("verify"): ...` times a phase into the call's stats and counts
  the host waits inside it (`syncs.HostSyncCounter`, where the drafter counts them);
- the output `generate` returns.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.cache_utils import DynamicCache
from transformers.generation.logits_process import PrefixConstrainedLogitsProcessor, RepetitionPenaltyLogitsProcessor
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..compat import GENERATE_CACHE_FIELD, compiled_forward, last_hidden_state_request, output_cache
from ..drafting.calibration import SamplingWarp
from ..drafting.drafter import BlockDrafter
from ..drafting.layer_features import only_last_position
from ..kv import grow_in_place, keep_every_key
from .accept import AcceptResult, HostStop, accept_tree, choose_tokens
from .binding import ModelBinding, binding_of
from .cost import ROW_PROBES
from .static_cache import is_static
from .stats import DecodingStats
from .support import AttentionWindows, drafting_context
from .syncs import HostSyncCounter, phase

# phases whose seconds the step clock adds to the call's stats (drafting books its own parts: heads, tree)
BOOKED_PHASES = {"prefill": "time_prefill", "verify": "time_verify", "accept": "time_accept", "cache": "time_cache"}


class StepClock:
    """Times the phases of a call's steps into `stats` (`BOOKED_PHASES`) and counts the host waits inside
    each phase when `count_syncs` (a test's or measurement's setting: counting costs a Python call per
    torch call). On an accelerator the clock synchronises the device at each reading only where the
    drafter profiles (`profile`): otherwise a reading there is when the host got there."""

    def __init__(self, stats: DecodingStats, device: torch.device, profile: bool, count_syncs: bool) -> None:
        self.stats = stats
        self.sync_device = device if profile and device.type == "cuda" else None
        self.syncs = HostSyncCounter() if count_syncs else None
        self.last = 0.0  # seconds of the last phase
        self.step_start = self.now()

    def now(self) -> float:
        if self.sync_device is not None:
            torch.cuda.synchronize(self.sync_device)
        return time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = self.now()
        with phase(self.syncs, name):
            yield
        self.last = self.now() - t0
        if name in BOOKED_PHASES:
            setattr(self.stats, BOOKED_PHASES[name], getattr(self.stats, BOOKED_PHASES[name]) + self.last)

    def start_step(self) -> None:
        self.step_start = self.now()

    def step_seconds(self) -> float:
        """Seconds since `start_step`: what the whole step cost."""
        return self.now() - self.step_start

    def close(self) -> None:
        """The counted host waits into the stats (`stats.host_syncs`)."""
        if self.syncs is not None:
            self.stats.host_syncs = dict(self.syncs.counts)


@dataclass
class Prefill:
    """The prompt's forward, as `generate` makes it, and the first token of every row."""

    past_mask: torch.Tensor  # [B, P]: 1 for the prompt's real tokens (left padding 0)
    cache: object
    hidden_last: torch.Tensor  # [B, H]: the last hidden state, the heads' input
    first: torch.Tensor  # [B]: each row's first new token
    sequences: list[torch.Tensor]  # each row's ids [1, P + 1], ending with its first token
    finished: list[bool]  # whether the first token already stopped the row
    hidden_prompt: torch.Tensor | None = None  # [B, P, H]: every prompt position's (an EAGLE layer's context)

    def state(self) -> tuple:
        """What a loop carries from step to step: (past_mask, cache, hidden_last, sequences, finished)."""
        return self.past_mask, self.cache, self.hidden_last, self.sequences, self.finished


@dataclass
class DecodeCall:
    """One `generate` call's settings and outputs (module docstring). Open it with `DecodeCall.open`."""

    model: object
    drafter: BlockDrafter
    binding: ModelBinding  # the drafter's, bound to `model` (`binding.prepare`)
    config: GenerationConfig
    processors: LogitsProcessorList
    criteria: StoppingCriteriaList
    streamer: object
    windows: AttentionWindows | None
    typical: tuple[float, float] | None
    prompt_len: int
    clock: StepClock
    do_sample: bool = False
    warp: SamplingWarp | None = None
    stop: HostStop | None = None
    context: int | None = None  # the positions trees are drafted within (None: unbounded)
    captured: bool | str | None = None  # `generate(captured_step=...)`: the captured step's setting (`captured.py`)
    scores: list[torch.Tensor] = field(default_factory=list)  # one row's per-token processed scores, when asked
    logits: list[torch.Tensor] = field(default_factory=list)  # ... and raw logits

    @classmethod
    def open(
        cls,
        model,
        drafter: BlockDrafter,
        input_ids: torch.Tensor,
        processors: LogitsProcessorList,
        criteria: StoppingCriteriaList,
        config: GenerationConfig,
        streamer=None,
        windows: AttentionWindows | None = None,
        typical: tuple[float, float] | None = None,
    ) -> DecodeCall:
        context = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
        clock = StepClock(drafter.stats, input_ids.device, drafter.profile, drafter.count_host_syncs)
        return cls(
            model,
            drafter,
            binding_of(drafter),
            config,
            processors,
            criteria,
            streamer,
            windows,
            typical,
            prompt_len=input_ids.shape[1],
            clock=clock,
            do_sample=bool(config.do_sample),
            warp=SamplingWarp.from_config(config),
            stop=HostStop.of(criteria),
            context=drafting_context(model, context, input_ids.shape[1]),
        )

    @property
    def stats(self) -> DecodingStats:
        return self.drafter.stats

    def step_chooser(self, plain_estimate=None, margin: float = 0.0, probes: tuple[int, int] = ROW_PROBES):
        """The call's `cost.StepChooser` for cost-sized ("auto") trees, or None (`ModelBinding.step_chooser`)."""
        return self.binding.step_chooser(self.drafter, plain_estimate, margin, probes)

    def observe(self, accepted_nodes: list[list[int]], finished: list[bool], tree_tokens: int, seconds) -> None:
        """One verification step fed back: the accepted nodes to the drafter's calibration
        (`BlockDrafter.observe`), the forward's width and time (None when not timed reliably) to the learned
        forward cost (`ModelBinding.observe_forward`)."""
        self.binding.observe_forward(tree_tokens, seconds)
        self.drafter.observe(accepted_nodes, finished)

    @property
    def pad(self) -> int:
        """The token finished rows are padded with (0 where the model names none: one row needs none)."""
        pad = self.config._pad_token_tensor
        return 0 if pad is None else int(pad)

    @property
    def plain_greedy(self) -> bool:
        """Greedy without logits processors, stopped by `HostStop`: a step's choices are one argmax."""
        return self.stop is not None and not self.do_sample and self.typical is None and len(self.processors) == 0

    def wants(self, output: str) -> bool:
        """Whether `generate` asked for per-token "scores" or "logits"."""
        return bool(self.config.return_dict_in_generate and getattr(self.config, f"output_{output}"))

    def prefill(self, input_ids: torch.Tensor, model_kwargs: dict) -> Prefill:
        """The prompt through the model exactly as `generate` runs it, and every row's first token."""
        with self.clock.phase("prefill"):
            past_mask = prompt_mask(input_ids, model_kwargs)
            logits, hidden, cache = prefill(self.model, input_ids, model_kwargs, self.drafter.reads_context)
            scores = self.processors(input_ids, logits)
            first = choose_tokens(scores, self.do_sample)
            rows = range(input_ids.shape[0])
            sequences = [torch.cat([input_ids[b : b + 1], first[b].view(1, 1)], dim=-1) for b in rows]
            finished = [bool(self.criteria(sequences[b], scores[b : b + 1]).any()) for b in rows]
        self.stats.new_tokens = len(sequences)
        for row in self.stats.rows:
            row.new_tokens = 1
        self.scores.append(scores)
        self.logits.append(logits)
        if self.streamer is not None:
            self.streamer.put(first.cpu())
        return Prefill(past_mask, cache, hidden[:, -1], first, sequences, finished, hidden)

    def max_depth(self, longest: int) -> int | None:
        """The deepest a tree may be drafted after `longest` cached tokens: its positions stay within the
        positions the model serves (None: unbounded)."""
        return None if self.context is None else max(self.context - longest - 1, 0)

    def walk(self, tree, logits: torch.Tensor, sequence: torch.Tensor, processors=None) -> AcceptResult:
        """One row's walk through its verified `tree` (`accept.accept_tree`) with the call's settings:
        `logits [N, V]` its nodes' raw logits, `sequence [1, L]` its ids ending with the root, `processors`
        the row's own (default: the call's)."""
        processors = self.processors if processors is None else processors
        return accept_tree(tree, logits, sequence, processors, self.criteria, self.do_sample, self.typical, self.stop)

    def emit(self, result: AcceptResult) -> None:
        """One row's accepted tokens: to the streamer, and their scores and logits where asked for."""
        if self.wants("scores"):
            self.scores.extend(s[None] for s in result.scores)
        if self.wants("logits"):
            self.logits.extend(x[None] for x in result.logits)
        if self.streamer is not None:
            for token in result.tokens:
                self.streamer.put(torch.tensor([token]))

    def output(self, sequences: list[torch.Tensor], cache=None):
        """What `generate` returns: for one row its ids (or `GenerateDecoderOnlyOutput` with the scores,
        logits and `cache` asked for), for a batch the rows padded on the right with the pad token, as plain
        batched `generate` returns them."""
        self.clock.close()
        if self.streamer is not None:
            self.streamer.end()
        if len(sequences) > 1:
            length = max(s.shape[1] for s in sequences)
            return torch.cat([torch.nn.functional.pad(s, (0, length - s.shape[1]), value=self.pad) for s in sequences])
        sequence = sequences[0]
        assert sequence.shape[1] - self.prompt_len == self.stats.new_tokens
        if not self.config.return_dict_in_generate:
            return sequence
        return GenerateDecoderOnlyOutput(
            sequences=sequence,
            scores=tuple(self.scores) if self.wants("scores") else None,
            logits=tuple(self.logits) if self.wants("logits") else None,
            **{GENERATE_CACHE_FIELD: cache if self.config.use_cache else None},
        )


def prompt_mask(input_ids: torch.Tensor, model_kwargs: dict) -> torch.Tensor:
    """The prompt's 2D mask of real tokens [B, P] (`generate` drops an all-ones mask: then all ones)."""
    mask = model_kwargs.get("attention_mask")
    return torch.ones_like(input_ids) if mask is None else mask


def prefill(
    model, input_ids: torch.Tensor, model_kwargs: dict, every_position: bool = False
) -> tuple[torch.Tensor, torch.Tensor, DynamicCache]:
    """Run the prompt exactly as `generate` does. Returns (raw next-token logits [B, V] float32, last
    hidden states [B, P, H] (with heads reading several layers, only the last position's is theirs, unless
    `every_position`: an EAGLE layer's context reads them all), cache)."""
    keep_every_key(model_kwargs)
    if not compiled_forward(model):  # a compiled forward lays each layer out its own way (`contiguous_kv`)
        grow_in_place(model_kwargs)
    # as `generate`'s first forward: with its multimodal inputs (images), which later steps drop
    first = {"is_first_iteration": True} if _takes_first_iteration(model) else {}
    model_inputs = model.prepare_inputs_for_generation(input_ids, **first, **model_kwargs)
    model_inputs["output_hidden_states"] = request = last_hidden_state_request(model)
    with contextlib.nullcontext() if every_position else only_last_position(model):
        out = model(**model_inputs, return_dict=True)
    cache = output_cache(out)
    if not isinstance(cache, DynamicCache) and not is_static(cache):
        raise ValueError(f"hf_bpd needs a DynamicCache (the default) or a StaticCache, got {type(cache).__name__}")
    hidden = out.hidden_states[-1] if out.hidden_states else None
    if hidden is None:
        raise ValueError(f"{type(model).__name__} returns no last hidden state (output_hidden_states={request})")
    if hidden.dim() != 3:
        raise ValueError(
            f"{type(model).__name__} returns last hidden states of shape {tuple(hidden.shape)}, not [batch, tokens, "
            "hidden]: draft heads cannot read them"
        )
    logits = out.logits[:, -1].to(copy=True, dtype=torch.float32)
    return logits, hidden, cache


def _takes_first_iteration(model) -> bool:
    return "is_first_iteration" in inspect.signature(model.prepare_inputs_for_generation).parameters


def row_processors(processors: LogitsProcessorList, row: int) -> LogitsProcessorList:
    """The processors plain batched `generate` built, as they apply to row `row` alone: `accept_tree` runs
    them on one row's sequence at a time, so state kept per batch row is cut to that row (the repetition
    penalty's per-row prompt padding, `prefix_allowed_tokens_fn`'s batch id)."""
    out = LogitsProcessorList()
    for processor in processors:
        if isinstance(processor, RepetitionPenaltyLogitsProcessor) and isinstance(
            processor.prompt_ignore_length, torch.Tensor
        ):
            processor = copy.copy(processor)
            processor.prompt_ignore_length = processor.prompt_ignore_length[row : row + 1]
        elif isinstance(processor, PrefixConstrainedLogitsProcessor):
            allowed = processor._prefix_allowed_tokens_fn
            processor = copy.copy(processor)
            processor._prefix_allowed_tokens_fn = lambda _, sent, allowed=allowed: allowed(row, sent)
        out.append(processor)
    return out
