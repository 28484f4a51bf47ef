"""`hf_bpd.generate`, the transformers `custom_generate` entry point:

    model.generate(**inputs, custom_generate=hf_bpd.generate, assistant=drafter, max_new_tokens=N)

It refuses what the loops would not decode exactly (`decode/support.py`, before any forward), then runs one
row through `decode/row.py` (on a static cache, optionally the captured step, `decode/captured.py`), a batch
through `decode/batch.py`, and a model with recurrent state (one row or a batch) through
`decode/recurrent.py`.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .compat import caller_streamer
from .decode.accept import typical_acceptance
from .decode.batch import check_batch_supported, decode_batch
from .decode.binding import prepare
from .decode.call import DecodeCall
from .decode.captured import check_captured_setting
from .decode.recurrent import decode_recurrent
from .decode.row import decode
from .decode.support import (
    check_call_supported,
    check_model_supported,
    has_recurrent_state,
    serving_drafter,
)
from .drafting.drafter import BlockDrafter
from .drafting.layer_features import decoding_features


def generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    synced_gpus: bool = False,
    streamer=None,
    assistant: BlockDrafter | None = None,
    lossy_typical_acceptance: bool | tuple[float, float] = False,
    captured_step: bool | str | None = None,
    **model_kwargs,
):
    """Lossless blockwise parallel decoding, greedy or sampled (`generation_config.do_sample`); see the
    module docstring. `assistant` is the `BlockDrafter`. `lossy_typical_acceptance` (sampling only, off by
    default): Medusa's typical acceptance, faster and NOT lossless (module docstring).

    `captured_step` (greedy on a static cache, one row): each step as one device function compiled once per
    tree size (`decode/captured.py`): None (default, auto: the devices `captured.AUTO_DEVICES` names, none yet),
    True always (refused where it cannot serve), False never, or the `torch.compile` backend to compile it with.

    `streamer`: given to `generate` the usual way it is found in the calling `generate` (which does not
    hand it to a callable custom_generate; `compat.caller_streamer`); one bound with
    `functools.partial(hf_bpd.generate, streamer=streamer)` works too.
    """
    if not isinstance(assistant, BlockDrafter):
        raise TypeError(
            "hf_bpd.generate needs the drafter: model.generate(..., custom_generate=hf_bpd.generate, "
            f"assistant=BlockDrafter(...)); got assistant={type(assistant).__name__}"
        )
    if generation_config.num_beams not in (None, 1):
        raise ValueError("hf_bpd.generate does not do beam search: pass num_beams=1")
    if (generation_config.num_return_sequences or 1) > 1:
        raise ValueError(
            f"hf_bpd.generate returns one sequence per input, got num_return_sequences="
            f"{generation_config.num_return_sequences}: repeat the input in the batch instead"
        )
    if synced_gpus:
        raise ValueError("hf_bpd.generate does not support synced_gpus")
    typical = typical_acceptance(lossy_typical_acceptance)
    if typical is not None and not generation_config.do_sample:
        raise ValueError("lossy_typical_acceptance changes how sampled tokens are accepted: it needs do_sample=True")
    check_model_supported(model)
    # an EAGLE layer's drafter hands the calls its layer does not serve to its fallback heads
    drafter = serving_drafter(model, assistant, generation_config, model_kwargs, input_ids.shape[0], captured_step)
    windows = check_call_supported(model, input_ids, generation_config, model_kwargs, drafter.tree_budget)
    batched = input_ids.shape[0] > 1
    check_captured_setting(captured_step, batched, has_recurrent_state(model))
    if batched:
        check_batch_supported(input_ids, generation_config, model_kwargs, logits_processor, drafter.rescorer)
        if streamer is not None or caller_streamer(model) is not None:
            raise ValueError("streamers take one sequence: hf_bpd.generate streams batches of size 1 only")
    elif streamer is not None:  # bound with functools.partial: the prompt is ours to put
        streamer.put(input_ids.cpu())
    else:  # given to generate the usual way: generate put the prompt already
        streamer = caller_streamer(model)
    # a model with recurrent state: one chain per step, the state restored where a draft fails
    loop = decode_recurrent if has_recurrent_state(model) else decode_batch if batched else decode
    fallback_lock = drafter.exclusive() if drafter is not assistant else contextlib.nullcontext()
    with assistant.exclusive(), fallback_lock, _prepared(model, drafter):
        call = DecodeCall.open(
            model,
            drafter,
            input_ids,
            logits_processor,
            stopping_criteria,
            generation_config,
            streamer,
            windows,
            typical,
        )
        call.captured = captured_step
        try:
            out = loop(call, input_ids, model_kwargs)
        finally:
            assistant.stats = drafter.stats  # the call's, where the user reads them (while still its own)
    if batched and generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=out)
    return out


@contextlib.contextmanager
def _prepared(model, drafter: BlockDrafter):
    """The drafter bound to `model` with fresh stats, and the whole decode (prefill, heads, tree forwards)
    inside its linear context: oneDNN packed weights on a CPU (`packed_linear.py`), the same kernels
    `hf_bpd.fast_cpu` gives plain `generate`."""
    binding = prepare(drafter, model)
    # heads reading several layers: hooks keep those layers' states and fuse them (`layer_features.py`)
    with binding.linear_context, decoding_features(model, drafter.heads):
        yield
    binding.review_forward_cost(drafter)
