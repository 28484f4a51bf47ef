"""The Hub-style entry point: what the `custom_generate/` folder's `generate` runs.

transformers calls a Hub `custom_generate` with the raw `generate` arguments. They go back to
`model.generate` with the installed `hf_bpd.generate` as the decoding function, so input preparation,
logits processors and stopping criteria are transformers' own and the result equals the callable style.
Two arguments need help on the way, because `generate` does not hand them to a callable custom_generate:
the streamer (bound to the decoding function) and the tokenizer, which `stop_strings` needs (turned into
a `StopStringCriteria` here).

Without `assistant=`, the drafter is the one saved in the repo or folder the strategy was loaded from
(`BlockDrafter.save_pretrained` / `push_to_hub` write such folders): loaded once per process and source,
then reused, so its calibration carries over from call to call. An explicit `assistant=` always wins.
"""

from __future__ import annotations

import functools

from transformers import StoppingCriteriaList, StopStringCriteria

from ..compat import calling_generate_argument
from ..drafting.drafter import BlockDrafter
from ..generation import generate

_saved_drafters: dict[str, BlockDrafter] = {}


def saved_drafter(source: str) -> BlockDrafter:
    """The drafter saved at `source` (a folder or Hub repo id), loaded once per process."""
    if source not in _saved_drafters:
        try:
            _saved_drafters[source] = BlockDrafter.from_pretrained(source)
        except (OSError, ValueError) as err:
            raise ValueError(
                f"{source} holds no drafter saved with BlockDrafter.save_pretrained ({err}): pass "
                "assistant=BlockDrafter(...) to generate"
            ) from err
    return _saved_drafters[source]


def hub_generate(model, *args, streamer=None, tokenizer=None, stop_strings=None, stopping_criteria=None, **kwargs):
    """`model.generate(*args, **kwargs)` decoded by `hf_bpd.generate` (see the module docstring)."""
    if kwargs.get("assistant") is None:
        source = calling_generate_argument(model, "custom_generate")
        if source is None:
            raise ValueError("hf_bpd's Hub generate needs assistant=BlockDrafter(...) or a saved drafter's folder")
        kwargs["assistant"] = saved_drafter(str(source))
    generation_config = kwargs.get("generation_config")
    if stop_strings is None and generation_config is not None and generation_config.stop_strings:
        stop_strings = generation_config.stop_strings
        kwargs["generation_config"] = generation_config = generation_config.__class__.from_dict(
            {**generation_config.to_dict(), "stop_strings": None}
        )
    if stop_strings:
        if tokenizer is None:
            raise ValueError("stop_strings needs the tokenizer: pass tokenizer=... to generate")
        stop = StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings)
        stopping_criteria = StoppingCriteriaList([*(stopping_criteria or []), stop])
    decode = functools.partial(generate, streamer=streamer) if streamer is not None else generate
    return model.generate(*args, custom_generate=decode, stopping_criteria=stopping_criteria, **kwargs)
