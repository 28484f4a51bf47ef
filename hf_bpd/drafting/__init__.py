"""What drafts: the heads, the lattice of their top-k, rescoring, the draft tree and its calibration.
Nothing here imports the decode side (`hf_bpd/decode/`, `generation.py`): binding a drafter to a model is
the decode side's work (`decode/binding.py`)."""
