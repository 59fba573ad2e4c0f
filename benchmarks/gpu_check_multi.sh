#!/usr/bin/env bash
# Multi-GPU check for a machine with N >= 2 GPUs (N in 2, 4, 8): the paths one GPU cannot exercise, over NCCL,
# each against one rank. Same model, seed, data and global batch (8 sequences of 256 tokens, fp32 so that
# the meshes differ only in reduction order); each run trains 4 steps and its loss must match the one-rank
# reference's at every step:
#   ref    torchrun 1 rank, 8 micro-batches accumulated
#   tp     TP 2 (+ sequence parallel) × FSDP N/2
#   pp     PP 2 (1F1B, micro-batches of 1) × FSDP N/2
#   hsdp   HSDP: 2 replicas × FSDP N/2 (at N=2 the shard group is one rank, still the FSDP path)
# One JSON summary (steps, losses' parity) in $WORK/summary.json, and $OUT when set. Budget: 300 s.
#
#   bash benchmarks/gpu_check_multi.sh               # on the GPU machine (after gpu_check.sh's setup: wheels)
#   bash benchmarks/gpu_check_multi.sh --dry-run-cpu # the same runs with gloo on CPU, 2 ranks, tiny (a test)
set -uo pipefail

MODE=gpu
case "${1:-}" in
    "") ;;
    --dry-run-cpu) MODE=cpu ;;
    *) echo "usage: bash benchmarks/gpu_check_multi.sh [--dry-run-cpu]" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."
REPO=$PWD
STEP_ORDER=(data ref tp pp hsdp)
declare -A LIMIT=([data]=15 [ref]=50 [tp]=70 [pp]=70 [hsdp]=70)
SLACK=$([[ $MODE == cpu ]] && echo "${GPU_CHECK_CPU_SLACK:-3}" || echo 1)
source benchmarks/gpu_check_lib.sh

WORK=${GPU_CHECK_WORK:-$REPO/gpu-check-multi-out}
mkdir -p "$WORK/figures"
rm -f "$WORK/steps.tsv" "$WORK/summary.json" "$WORK"/figures/*.json
exec > >(tee "$WORK/gpu_check_multi.log") 2>&1
print_budget 300 || exit 2
trap 'copy_out gpu_check_multi.log' EXIT
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}${GPU_CHECK_SITE:+:$GPU_CHECK_SITE}
export PYTHONUNBUFFERED=1 LLMCLUSTER_STORAGE=$WORK/storage
PY=$(pick_python) || exit 1

if [[ $MODE == gpu ]]; then
    N=${GPU_CHECK_NPROC:-$("$PY" -c 'import torch; print(torch.cuda.device_count())')}
    DEVICE=cuda TOL=${GPU_CHECK_TOL:-2e-3}   # fp32 on GPU: TF32 off, but cuBLAS/NCCL reduction orders differ
    SHAPE=(--set model.n_layers=4 --set model.d_model=1024 --set model.n_heads=16 --set model.n_kv_heads=4
           --set model.ffn_hidden=2816 --set data.seq_len=256)
else
    N=2 DEVICE=cpu TOL=1e-4                  # gloo on CPU: the tolerance tests/test_parallel.py holds meshes to
    export OMP_NUM_THREADS=1
    SHAPE=(--set model.n_layers=4 --set model.d_model=64 --set model.n_heads=4 --set model.n_kv_heads=2
           --set model.ffn_hidden=128 --set data.seq_len=32 --set train.threads=1)
fi
case $N in 2|4|8) ;; *) echo "error: $N GPUs: this check needs 2, 4 or 8 (global batch 8)" >&2; exit 2 ;; esac
echo "python: $PY ($MODE), $N ranks, loss tolerance $TOL"
HALF=$((N / 2))

prepare_data
# train RUN NPROC GRAD_ACCUM MESH...: 4 steps of the same model and data; micro-batches of one sequence.
train() {
    local run=$1 nproc=$2 accum=$3; shift 3
    rm -rf "$WORK/storage/checkpoints/$run" "$WORK/storage/logs/$run"
    run "$run" "$PY" -m torch.distributed.run --standalone --nproc-per-node "$nproc" -m llmcluster train \
        --config llm_tiny --root "$WORK/storage" "${SHAPE[@]}" --set run.name="$run" --set data.dataset=gpucheck \
        --set model.vocab_size=257 --set train.device=$DEVICE --set train.precision=fp32 --set train.compile=false \
        --set train.steps=4 --set train.warmup_steps=2 --set train.micro_batch=1 --set train.grad_accum="$accum" \
        --set log.interval=1 --set log.eval_interval=1000 --set log.progress=false \
        --set checkpoint.interval_steps=1000 "$@"
}
train ref 1 8 --set parallel.dp_replicate=1 --set parallel.dp_shard=1
train tp "$N" $((8 / HALF)) --set parallel.tp=2 --set parallel.dp_replicate=1 --set parallel.dp_shard=-1
train pp "$N" $((8 / HALF)) --set parallel.pp=2 --set parallel.dp_replicate=1 --set parallel.dp_shard=-1
train hsdp "$N" $((8 / N)) --set parallel.dp_replicate=2 --set parallel.dp_shard=-1

printf '\n=== parity (tolerance %s)\n' "$TOL"
for r in tp pp hsdp; do
    "$PY" benchmarks/gpu_check_summary.py parity "$WORK/storage/logs" ref "$r" --tol "$TOL" \
        --figures "$WORK/figures/$r.json" || mark_failed "$r" "loss differs from one rank"
done
"$PY" benchmarks/gpu_check_summary.py summary "$WORK"
if (( STATUS )); then echo "FAILED: ${FAILED[*]}"; else echo "gpu_check_multi: all steps passed"; fi
exit $STATUS
