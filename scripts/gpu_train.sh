#!/usr/bin/env bash
# One prepared command for one H200-class GPU (budget: < 12 minutes end to end): build the teacher data by batched
# generation, train the gated-LoRA MTP adapter, evaluate, and leave the adapter (< 16 MB) in $OUT/adapter.
#
#   OUT=out/gpu scripts/gpu_train.sh
#   DEVICE=cpu TINY=1 OUT=/tmp/gpu-dry scripts/gpu_train.sh     # the CPU dry run of the same pipeline (minutes)
#
# Then ship it:  cp $OUT/adapter/* agent_mtp/adapters/smollm2-135m-instruct/
set -euo pipefail
OUT=${OUT:-out/gpu}
DEVICE=${DEVICE:-cuda}
if [[ "${TINY:-0}" == 1 ]]; then
  DATA_ARGS=(--agent-prompts 8 --sharegpt-prompts 2 --max-response-tokens 16 --gen-batch 8 --data-minutes 2)
  TRAIN_ARGS=(--steps 2 --regions 16 --seq-len 96 --max-minutes 2 --eval-every 0 --eval-prompts 2
              --eval-max-new-tokens 8 --threads 1)
else
  # data <= 2.5 min: 6000 prompts x <= 128 tokens, batch 256 (teacher = the bf16-free fp32 base model on the GPU)
  DATA_ARGS=(--agent-prompts 5000 --sharegpt-prompts 1000 --max-response-tokens 128 --gen-batch 256 --data-minutes 2.5)
  # train <= 5.5 min: seq 1024, 256 regions x 7 masks = 1792 supervised slots per step, bf16 twin of the base
  TRAIN_ARGS=(--steps 3000 --regions 256 --seq-len 1024 --max-minutes 5.5 --eval-every 1000 --eval-prompts 16
              --eval-max-new-tokens 64)
fi
agent-mtp distill --device "$DEVICE" --build-data --data-dir "$OUT/data" "${DATA_ARGS[@]}" \
  --out "$OUT/run" --adapter gated-lora --rank 8 --layers all --k-max 8 --model-dtype bf16 --lr 3e-4 --warmup 50 \
  --checkpoint-minutes 3 --no-progress "${TRAIN_ARGS[@]}" | tee "$OUT.log"
# the best held-out verified tokens/forward, else the final adapter
SRC="$OUT/run/best"; [[ -f "$SRC/adapter.safetensors" ]] || SRC="$OUT/run/adapter"
mkdir -p "$OUT/adapter" && cp "$SRC"/adapter_config.json "$SRC"/adapter.safetensors "$OUT/adapter/"
cp "$OUT/run/log.jsonl" "$OUT/run/curves.png" "$OUT/" 2>/dev/null || true
du -sh "$OUT/adapter"
