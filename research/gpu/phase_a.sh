#!/bin/bash
# Device call A (README "GPU measurements"): install the carried wheels, smoke-test hf_bpd on CUDA, and time
# random-weight Llama-shaped forwards and drafting for the cost model. Run from the repository root there.
source research/gpu/env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $OUT/gpu.txt
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a $OUT/gpu.txt
timeout 120 python3 research/gpu/smoke.py 2>&1 | tee $OUT/smoke.txt
timeout 330 python3 -m hf_bpd.tools.cost_model --shapes 135m 1b 7b --context 256 --repeats 10 --device cuda \
    ${REPLAY:+--replay $REPLAY} --output $OUT/cost_model.json 2>&1 | tail -60
