"""What drafts: the heads, the lattice of their top-k, rescoring, the draft tree and its calibration.
Nothing here imports the decode loops."""
