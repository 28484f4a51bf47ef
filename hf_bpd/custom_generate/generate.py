"""hf_bpd as a Hub `custom_generate` strategy.

    model.generate(**inputs, custom_generate="<repo or folder holding custom_generate/>",
                   trust_remote_code=True, assistant=drafter, max_new_tokens=N)

transformers calls this function with the raw `generate` arguments. It hands them back to `generate` with
the installed `hf_bpd.generate` as the decoding function, so input preparation, logits processors and
stopping criteria are transformers' own and the result is identical to the callable style. The decoding
code itself lives in one place, the `hf_bpd` package (see requirements.txt).
"""

import functools

import hf_bpd


def generate(model, *args, streamer=None, **kwargs):
    # transformers does not pass `streamer` to a callable custom_generate: bind it.
    decode = functools.partial(hf_bpd.generate, streamer=streamer) if streamer is not None else hf_bpd.generate
    return model.generate(*args, custom_generate=decode, **kwargs)
