"""hf_bpd as a Hub `custom_generate` strategy.

    model.generate(**inputs, custom_generate="<repo or folder holding custom_generate/>",
                   trust_remote_code=True, max_new_tokens=N)   # + assistant=drafter unless the folder
                                                               # is a saved drafter's

transformers calls this function with the raw `generate` arguments; `hf_bpd.io.hub.hub_generate` hands them
back to `generate` with the installed `hf_bpd.generate` as the decoding function, so the result is
identical to the callable style. The code itself lives in one place, the `hf_bpd` package (see
requirements.txt).
"""

from hf_bpd.io.hub import hub_generate


def generate(model, *args, **kwargs):
    return hub_generate(model, *args, **kwargs)
