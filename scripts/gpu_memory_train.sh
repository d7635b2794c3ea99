#!/usr/bin/env bash
# The memory recipe's trainings in one GPU call of under 10 minutes (issue 15; CI has no GPU):
#   1. history policy through the full cache (whole episodes, goal and cue-count losses) beside the single-frame
#      policy, T1 minutes each;
#   2. a chunk gate fitted to the frozen full model (TG minutes, budget 128 chunks per layer, chunk_mass);
#   3. every weight fine-tuned through that chunked cache for what is left before END seconds.
# The data comes packed by `python -m vla_finetune.frame_pack pack` (PACKED: meta.tar + cache.tar.xz). The three
# models come back in OUT as 15-MiB tar parts (the device tool returns files of at most 16 MiB) without
# tokenizer.json (the init's, equal to every tiny checkpoint's), the logs as logs.tar:
#
#   # here:   python -m vla_finetune.frame_pack pack runs/memory/data .device/data
#   # device: OUT=$OUT PACKED=.device/data bash scripts/gpu_memory_train.sh          (carry .device)
#   # here:   for m in full single f2c; do cat PARTS/$m.tar.part-* | tar -x; cp INIT/tokenizer.json $m/; done
#
# Stages whose model exists in WORK are skipped. DEVICE=cpu with small budgets runs the same path on a CPU.
# A later lease goes on from an earlier one's models (carried in .device, tokenizer.json may be left out): FULL_FROM
# starts stage 1 from that full-cache model instead of the random init; F2C_FROM trains that chunked model further
# beside stage 1, for T1 minutes as well, in place of the gate fit and step 3. LR1: stage 1's peak learning rate;
# CUE_W: the cue-count loss's weight in both; SINGLE=0 skips the single-frame policy (the earlier lease's serves).
set -u
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}
T1=${T1:-4.0}              # minutes of stage 1 (both policies)
TG=${TG:-0.75}             # minutes of the gate fit
END=${END:-570}            # seconds after the start by which every training has written its model
STARTUP=${STARTUP:-45}     # a training process's seconds before its own budget starts counting
THREADS=${THREADS:-4}
FULL_FROM=${FULL_FROM:-}   # empty: stage 1 from the random init (--from-scratch of WORK/init)
LR1=${LR1:-1e-3}           # stage 1's peak learning rate
CUE_W=${CUE_W:-1}          # the cue-count loss's weight
SINGLE=${SINGLE:-1}        # 0: no single-frame policy
F2C_FROM=${F2C_FROM:-}     # empty: gate fit and chunked fine-tune after stage 1
PACKED=${PACKED:-.device/data}
OUT=${OUT:-results/memory-gpu}
WORK=${WORK:-/tmp/memory-gpu}
LOGS=$WORK/logs
mkdir -p "$OUT" "$WORK" "$LOGS"
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$OUT/steps.log"; }
have() { [ -f "$WORK/$1/model.safetensors" ] || [ -f "$WORK/$1/gates.safetensors" ]; }

command -v vla-runtime >/dev/null || "$PY" -m pip install -q --no-deps --no-build-isolation -e . > "$LOGS/pip.log" 2>&1
CLI=$(command -v vla-runtime) || { stamp "no vla-runtime: see $LOGS/pip.log"; exit 2; }
"$PY" -m vla_finetune.frame_pack unpack "$PACKED" "$WORK" >> "$OUT/steps.log" 2>&1 || { stamp "unpacking failed"; exit 2; }
[ -f "$WORK/init/config.json" ] || "$PY" -c "import sys, torch; from vla_finetune.recipes.metaworld_memory import llm_geometry
from vla_runtime.checkpoints.tiny_openvla import make_tiny_openvla  # what the memory recipe makes
make_tiny_openvla(sys.argv[1], seed=0, image_size=84, proprio_dim=4, llm=llm_geometry(128, 4), dtype=torch.float32)" \
    "$WORK/init" >> "$OUT/steps.log" 2>&1 || { stamp "no init checkpoint"; exit 2; }
for from in "$FULL_FROM" "$F2C_FROM"; do  # an earlier lease's model travels without the (init's) tokenizer
    [ -z "$from" ] || [ -f "$from/tokenizer.json" ] || cp "$WORK/init/tokenizer.json" "$from/"
done
stamp "data and init ready ($CLI)"

common=(finetune --dataset "$WORK/data" --camera corner --dataset-name metaworld_memory --lr-schedule cosine
        --max-steps 100000 --save-dtype bfloat16 --device "$DEVICE" --threads "$THREADS" --cache-dir "$WORK/frame-cache")
chunked=(--history observations --kv chunked --window 0 --chunk 16 --max-chunks 128 --chunk-mass --gate-budget hard
         --retention-weight 0 --batch-size 16)

have full || "$CLI" "${common[@]}" --from-scratch --checkpoint "${FULL_FROM:-$WORK/init}" --history observations \
    --window 0 --kv full --batch-size 16 --lr "$LR1" --warmup-steps 20 --goal-weight 1 --cue-weight "$CUE_W" \
    --time-budget "$T1" --seed 0 --out "$WORK/full" > "$LOGS/full.log" 2>&1 &
full_pid=$!
have single || [ "$SINGLE" = 0 ] || "$CLI" "${common[@]}" --from-scratch --checkpoint "$WORK/init" --history single --kv full --batch-size 256 \
    --lr 1e-3 --warmup-steps 20 --time-budget "$T1" --seed 0 --out "$WORK/single" > "$LOGS/single.log" 2>&1 &
single_pid=$!
f2c_args=("${chunked[@]}" --lr 2e-4 --gate-lr 1e-3 --warmup-steps 10 --goal-weight 1 --cue-weight "$CUE_W" --seed 1
          --out "$WORK/f2c")
if [ -n "$F2C_FROM" ]; then  # an earlier chunked model goes on beside stage 1
    have f2c || "$CLI" "${common[@]}" --from-scratch --checkpoint "$F2C_FROM" "${f2c_args[@]}" --time-budget "$T1" \
        > "$LOGS/f2c.log" 2>&1
    stamp "f2c (from $F2C_FROM): exit $?"
    wait $full_pid; stamp "full: exit $?"
else  # a gate fitted to the new full model, then every weight fine-tuned through the chunked cache
    wait $full_pid; stamp "full: exit $?"
    have gates || "$CLI" "${common[@]}" --gates-only --checkpoint "$WORK/full" "${chunked[@]}" --warmup-steps 10 \
        --goal-weight 0 --time-budget "$TG" --seed 0 --out "$WORK/gates" > "$LOGS/gates.log" 2>&1
    stamp "gates: exit $?"
    "$PY" -c "import sys; from pathlib import Path; from vla_finetune.recipes.metaworld_memory import gated_checkpoint
gated_checkpoint(*map(Path, sys.argv[1:]))" "$WORK/full" "$WORK/gates" "$WORK/gated" >> "$OUT/steps.log" 2>&1
    left=$(( END - ($(date +%s) - t0) - STARTUP ))
    budget=$("$PY" -c "print(round(max(0.3, $left / 60), 2))")
    stamp "f2c: $budget min"
    have f2c || timeout $(( END + 20 - ($(date +%s) - t0) )) "$CLI" "${common[@]}" --from-scratch \
        --checkpoint "$WORK/gated" "${f2c_args[@]}" --time-budget "$budget" > "$LOGS/f2c.log" 2>&1
    stamp "f2c: exit $?"
fi
wait $single_pid; stamp "single: exit $?"

for m in full single f2c; do
    have $m && tar -C "$WORK" -cf - --exclude tokenizer.json --exclude checkpoints "$m" | split -b 15m - "$OUT/$m.tar.part-"
done
tar -C "$WORK" -cf "$OUT/logs.tar" logs
stamp "packed into $OUT"
