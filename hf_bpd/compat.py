"""Where hf_bpd meets parts of transformers' API that differ between versions, or that transformers does
not hand to a `custom_generate` callable. Everything version- or call-path-specific lives here.

- The KV cache's name: transformers 5.24 renamed the forward argument and the output field
  `past_key_values` to `cache` (the old name is deprecated and goes in 5.40); models written against the
  old name still take `past_key_values`. Every place that hands a model its cache or reads one back asks
  `cache_argument` / `output_cache` which name this model and this transformers use.
- The streamer: `generate` passes a callable `custom_generate` only the arguments its own sampling loop
  lacks, so a `streamer=` given the usual way never reaches it, although `generate` has already put the
  prompt into it. `caller_streamer` finds it in the calling `generate`, so the usual call streams and ends.
- The last hidden state alone: `output_hidden_states=True` keeps every layer's output of the forward
  alive until it returns, which on a CPU turns a prefill's freed activations into fresh memory (glibc
  maps and faults in new pages for them) and makes a batch's prefill slower than `generate`'s own.
  transformers 5 takes an index there instead (`LAST_HIDDEN_STATE`): only the last layer's is kept, still
  as `hidden_states[-1]`; models that read the flag as a plain truth value keep them all, as before.
  transformers resolves that index against `num_hidden_layers`, so it selects nothing in a model whose
  layers of one kind may not run (Mllama skips its cross-attention layers on text alone): a model that
  records its hidden states from layers of several classes is asked for all of them
  (`last_hidden_state_request`).
- The Hub folder: `generate` does not tell a Hub `custom_generate` which repo or folder it came from;
  `calling_generate_argument(model, "custom_generate")` does, so a saved drafter's folder loads itself.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys

from transformers.generation.utils import GenerateDecoderOnlyOutput

CACHE_NAMES = ("cache", "past_key_values")
# `output_hidden_states=` that keeps the last layer's hidden state only (module docstring)
LAST_HIDDEN_STATE = -1


def last_hidden_state_request(model) -> int | bool:
    """What to pass `model` as `output_hidden_states=` so that `hidden_states[-1]` is its last hidden state:
    `LAST_HIDDEN_STATE` where the index is safe, `True` (every layer's) where it may select nothing."""
    return _last_hidden_state_request_of(type(model))


@functools.lru_cache(maxsize=256)
def _last_hidden_state_request_of(model_class) -> int | bool:
    recorders = (getattr(model_class, "_can_record_outputs", None) or {}).get("hidden_states")
    several_layer_kinds = isinstance(recorders, (list, tuple)) and len(recorders) > 1
    return True if several_layer_kinds else LAST_HIDDEN_STATE


def cache_argument(model) -> str | None:
    """The name under which `model.forward` takes its KV cache, or None when it takes none (asked once per
    forward function: verification asks every step)."""
    return _cache_argument_of(getattr(model.forward, "__func__", model.forward))


@functools.lru_cache(maxsize=256)
def _cache_argument_of(forward) -> str | None:
    params = inspect.signature(forward).parameters
    return next((name for name in CACHE_NAMES if name in params), None)


def output_cache(output):
    """The cache a model output (a `ModelOutput`) carries, under either field name."""
    for name in CACHE_NAMES:
        if output.get(name) is not None:
            return output[name]
    return None


_GENERATE_FIELDS = {f.name for f in dataclasses.fields(GenerateDecoderOnlyOutput)}
GENERATE_CACHE_FIELD = next(name for name in CACHE_NAMES if name in _GENERATE_FIELDS)


def calling_generate_argument(model, name: str, max_depth: int = 8):
    """The argument `name` of the `model.generate(...)` call that is running this code, or None.

    Looks a few frames up for the body of transformers' `GenerationMixin.generate` of this very model (its
    decorators add frames of their own) and reads its local `name`."""
    frame = sys._getframe(1)
    for _ in range(max_depth):
        frame = frame.f_back
        if frame is None:
            return None
        code = frame.f_code
        if code.co_name == "generate" and "generation" in code.co_filename and frame.f_locals.get("self") is model:
            return frame.f_locals.get(name)
    return None


def caller_streamer(model):
    """The `streamer` given the usual way to the `generate` call running this custom_generate, or None.
    That `generate` already put the prompt into it, so the caller must not put it again."""
    return calling_generate_argument(model, "streamer")


def compiled_forward(model) -> bool:
    """Whether `model.forward` was replaced by a `torch.compile`d function (transformers' documented way
    to compile a model for `generate`). Such a graph brings its own kernels (inductor's freezing packs
    the weights as constants), and swapping linears under it would break its guards, so hf_bpd then
    leaves the model's linears alone and runs its tree forwards through that same compiled forward (its
    draft heads, which run outside the graph, keep packed kernels: `decode.binding.heads_kernels`)."""
    forward = model.__dict__.get("forward")
    return forward is not None and hasattr(forward, "_torchdynamo_orig_callable")
