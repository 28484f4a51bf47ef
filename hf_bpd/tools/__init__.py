"""Tools around the library: benchmark, replay, paper analyses, demo, cost model (the `hf-bpd` commands)."""
