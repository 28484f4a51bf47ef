#!/bin/bash
# Device call C (README "GPU measurements"): no real weights travel. Smoke-test hf_bpd on CUDA, then the cost
# model with plain greedy `generate` timed per token (dynamic cache, eager; static cache, which transformers
# compiles with CUDA graphs on a GPU): hf_bpd's tree step against the fastest plain generate, with τ(n) from
# the shipped heads' replay (benchmarks/speed/limit_pc2.json). Eager trees first, then trees through a
# torch.compile'd forward. Each step has its own time limit, so a slow one leaves the others' files.
source research/gpu/env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $OUT/gpu.txt
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a $OUT/gpu.txt
timeout ${TS:-60} python3 research/gpu/smoke.py 2>&1 | tee $OUT/smoke.txt
R="--replay benchmarks/speed/limit_pc2.json --context 256 --repeats ${REPEATS:-5} --tree-sizes 1 2 4 8 16 32 64"
timeout ${T1:-150} python3 -m hf_bpd.tools.cost_model --shapes 135m --dtype float32 --plain $R \
    --output $OUT/plain_135m_fp32.json 2>&1 | tail -16
timeout ${T2:-110} python3 -m hf_bpd.tools.cost_model --shapes 1b --dtype bfloat16 --plain $R \
    --output $OUT/plain_1b_bf16.json 2>&1 | tail -16
timeout ${T3:-150} python3 -m hf_bpd.tools.cost_model --shapes 135m --dtype float32 --plain --compiled-trees $R \
    --output $OUT/plain_135m_fp32_compiled_trees.json 2>&1 | tail -16
rm -f $OUT/*.md  # at most 8 files come back; the tables are rebuilt from the JSON
ls -la $OUT
