#!/usr/bin/env bash
# The CPU recipe that produced the shipped adapter agent_mtp/adapters/smollm2-135m-instruct/ (see docs/default-model.md).
# Runs in the background-friendly JSON-lines mode; one torch thread (the machine's 2 cores are shared).
#
#   scripts/train_default_adapter.sh                 # build data (15 min cap) + train (82 min cap)
#   RESUME=checkpoints/smollm2-135m-instruct scripts/train_default_adapter.sh   # continue
set -euo pipefail
DATA=${DATA:-runs/data}
OUT=${OUT:-runs/default}
MINUTES=${MINUTES:-82}
STEPS=${STEPS:-400}
RESUME_ARGS=()
if [[ -n "${RESUME:-}" ]]; then RESUME_ARGS=(--resume "$RESUME"); fi

# 1. teacher data: 840 agent prompts + 160 ShareGPT prompts, greedy, <= 96 new tokens, resumable; capped at 15 min
#    (the shipped run got 416 responses in that time: 393 train, 23 held out).
if [[ ! -s "$DATA/responses.jsonl" ]]; then
  agent-mtp distill --build-data --data-dir "$DATA" --agent-prompts 840 --sharegpt-prompts 160 \
    --max-response-tokens 96 --gen-batch 32 --data-minutes 15 --steps 1 --max-minutes 0.01 --eval-prompts 0 \
    --out "$OUT.data-only" --threads 1 --no-progress
fi

# 2. self-distillation: gated LoRA rank 8 on layers 8-29 + mask embedding, k_max 4, bf16 student
agent-mtp distill --data-dir "$DATA" --out "$OUT" --adapter gated-lora --rank 8 --layers 8-29 --k-max 4 \
  --regions 160 --seq-len 384 --bf16 --lr 5e-4 --warmup 15 --steps "$STEPS" \
  --eval-every 130 --eval-prompts 6 --eval-max-new-tokens 40 --checkpoint-minutes 5 \
  --max-minutes "$MINUTES" --threads 1 --no-progress "${RESUME_ARGS[@]}"
