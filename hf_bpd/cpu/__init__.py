"""hf_bpd's CPU backend behind `fast_cpu`: packed and streamed linear kernels, grouped attention, host
memory reuse. The kernels import neither the decode loops nor the drafting."""
