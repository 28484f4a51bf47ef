"""The KV-cache argument under both of its names.

transformers 5.24 renamed the forward argument and the output field `past_key_values` to `cache` (the old
name is deprecated, and goes in 5.40); models written against the old name still take `past_key_values`.
hf_bpd supports the whole transformers 5 range, so every place that hands a cache to a model or reads one
back asks here which name this model and this transformers use.
"""

from __future__ import annotations

import dataclasses
import inspect

from transformers.generation.utils import GenerateDecoderOnlyOutput

CACHE_NAMES = ("cache", "past_key_values")


def cache_argument(model) -> str | None:
    """The name under which `model.forward` takes its KV cache, or None when it takes none."""
    params = inspect.signature(model.forward).parameters
    return next((name for name in CACHE_NAMES if name in params), None)


def output_cache(output):
    """The cache a model output (a `ModelOutput`) carries, under either field name."""
    for name in CACHE_NAMES:
        if output.get(name) is not None:
            return output[name]
    return None


_GENERATE_FIELDS = {f.name for f in dataclasses.fields(GenerateDecoderOnlyOutput)}
GENERATE_CACHE_FIELD = next(name for name in CACHE_NAMES if name in _GENERATE_FIELDS)
