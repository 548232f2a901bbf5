#!/usr/bin/env bash
# The CPU recipe of the shipped adapter agent_mtp/adapters/smollm2-135m-instruct/ (see docs/default-model.md).
# JSON-lines progress for nohup; 2 torch threads (the machine's 2 cores).
#
#   scripts/train_default_adapter.sh                 # build data (20 min cap) + train from scratch
#   RESUME=checkpoints/smollm2-135m-instruct scripts/train_default_adapter.sh   # continue the committed checkpoint
#   (phase 4 of the shipped adapter: RESUME=... STEPS=4200 LR=3e-4 EVAL_EVERY=500 MINUTES=85 SEQ_LEN=384 REGIONS=256;
#    phase 5: RESUME=... STEPS=5400 LR=6e-4 EVAL_EVERY=400 MINUTES=80, 768 real tokens and 512 regions per step)
set -euo pipefail
DATA=${DATA:-runs/data}
OUT=${OUT:-runs/default}
MINUTES=${MINUTES:-95}
STEPS=${STEPS:-2300}
THREADS=${THREADS:-2}
LR=${LR:-5e-4}
EVAL_EVERY=${EVAL_EVERY:-400}
TRAIN_LAYERS=${TRAIN_LAYERS:-all}
SEQ_LEN=${SEQ_LEN:-768}
# each record's real-token pass (~3.5 MB: KV of 30 layers in bf16 + teacher argmax), kept on disk for later phases
REAL_PASS_DIR=${REAL_PASS_DIR:-$DATA/real-pass-cache}
REGIONS=${REGIONS:-512}
RESUME_ARGS=()
if [[ -n "${RESUME:-}" ]]; then RESUME_ARGS=(--resume "$RESUME"); fi

# 1. teacher data: 1600 agent prompts + 400 ShareGPT prompts (interleaved), greedy, <= 96 new tokens, resumable; capped at 20 min
if [[ ! -s "$DATA/responses.jsonl" ]]; then
  agent-mtp distill --build-data --data-dir "$DATA" --agent-prompts 1600 --sharegpt-prompts 400 \
    --max-response-tokens 96 --gen-batch 48 --data-minutes 20 --data-only --threads "$THREADS" --no-progress
fi

# 2. self-distillation: gated LoRA rank 8 on layers 8-29 (+ the mask embedding until step 394), k_max 4; the fast
#    trainer path: bf16 twin of the base weights with an fp32 head for the targets, banded slot attention, teacher
#    targets reused from the real-token pass, each record's real-token pass computed once and read back on later draws
#    (--real-pass-cache auto; on disk in $REAL_PASS_DIR for later phases), fused head cross-entropy (all defaults);
#    768 real tokens and up to 512 regions per step.
agent-mtp distill --data-dir "$DATA" --out "$OUT" --adapter gated-lora --rank 8 --layers 8-29 --k-max 4 \
  --model-dtype bf16 --regions "$REGIONS" --seq-len "$SEQ_LEN" --lr "$LR" --warmup 15 --steps "$STEPS" \
  --freeze-embedding-after 394 --train-layers "$TRAIN_LAYERS" --eval-every "$EVAL_EVERY" --eval-prompts 6 \
  --eval-max-new-tokens 40 --checkpoint-minutes 5 --max-minutes "$MINUTES" --threads "$THREADS" --no-progress \
  --real-pass-dir "$REAL_PASS_DIR" "${RESUME_ARGS[@]}"
