#!/usr/bin/env bash
# One-GPU check of the CUDA training path, in under 8 minutes on an H100/H200-class GPU:
#   1. the pytest tests that need CUDA (tests/test_gpu.py: NCCL, FSDP bf16 policy, fused AdamW, HF parity);
#   2. `llmcluster bench` on llm_1b and on a Llama-3-8B shape: FSDP on one rank (torchrun), bf16,
#      torch.compile per block, selective activation checkpointing; prints MFU vs the datasheet peak;
#   3. `llmcluster validate compute memory --json`, where that command exists.
#
#   bash benchmarks/gpu_check.sh            # results under $OUT (or ./gpu-check-out)
#
# Python: $PYTHON if set; else the first of .venv/bin/python, python3 whose torch sees CUDA; else a new
# venv that inherits the machine's site-packages (its CUDA torch build) and installs the rest if it can.
set -euo pipefail

cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-$REPO/gpu-check-out}
mkdir -p "$OUT"
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$OUT/inductor-cache}
export LLMCLUSTER_STORAGE=$OUT/storage
STATUS=0

log() { printf '\n=== %s  [%s]\n' "$*" "$(date +%H:%M:%S)"; }

has_cuda_torch() { "$1" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }

pick_python() {
    if [[ -n "${PYTHON:-}" ]]; then echo "$PYTHON"; return; fi
    for py in "$REPO/.venv/bin/python" "$(command -v python3 || true)"; do
        if [[ -n "$py" && -x "$py" ]] && has_cuda_torch "$py"; then echo "$py"; return; fi
    done
    # A venv on top of the system's packages keeps the machine's CUDA torch; pip fills in the rest.
    local venv=$REPO/.venv-gpu
    if [[ ! -x $venv/bin/python ]]; then
        python3 -m venv --system-site-packages "$venv" >&2
    fi
    if ! has_cuda_torch "$venv/bin/python"; then
        timeout 300 "$venv/bin/pip" install -q torch >&2 || true
    fi
    timeout 300 "$venv/bin/pip" install -q -e "$REPO" >&2 || \
        timeout 120 "$venv/bin/pip" install -q pydantic pyyaml rich pytest transformers >&2 || true
    echo "$venv/bin/python"
}

PY=$(pick_python)
log "python: $PY"
# The project's own dependencies (pyproject's addopts need pytest-timeout); installs only what is missing.
if ! "$PY" -c 'import pydantic, yaml, rich, pytest, pytest_timeout, transformers' 2>/dev/null; then
    timeout 300 "$PY" -m pip install -q pydantic pyyaml rich pytest pytest-timeout transformers \
        || echo "warning: could not install the Python dependencies; some steps will fail"
fi
"$PY" - <<'EOF'
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, available {torch.cuda.is_available()}")
assert torch.cuda.is_available(), "no CUDA device visible to torch"
p = torch.cuda.get_device_properties(0)
print(f"GPU 0: {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs")
EOF
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit \
    --format=csv || true

# run STEP_NAME TIMEOUT_S CMD...: a failed or timed-out step is reported and the script goes on.
run() {
    local name=$1 limit=$2; shift 2
    log "$name (limit ${limit}s)"
    local rc=0
    timeout --signal=TERM --kill-after=15 "$limit" "$@" 2>&1 | tee "$OUT/$name.log" || rc=${PIPESTATUS[0]}
    if [[ $rc -ne 0 ]]; then
        echo "!!! $name failed (exit $rc; 124 = timed out)"; STATUS=1
    fi
    return $rc
}

run pytest-gpu 240 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_gpu.py || true

BENCH=(-m torch.distributed.run --standalone --nproc-per-node 1 -m llmcluster bench --steps 8 --warmup 3
       --root "$OUT/storage"
       --set train.precision=bf16 --set train.compile=true --set parallel.dp_shard=-1
       --set parallel.dp_replicate=1)

run bench-1b 200 "$PY" "${BENCH[@]}" --config llm_1b --set parallel.activation_checkpoint=selective \
    --set run.name=gpu-1b || true

# Llama-3-8B: 8.03B params; fp32 master weights + grads + AdamW = 16 B/param = 120 GiB on one rank, so
# activations get what is left. Selective AC first; full AC if that does not fit.
L3_8B=(--config llm_7b --set model.n_layers=32 --set model.d_model=4096 --set model.n_heads=32
       --set model.n_kv_heads=8 --set model.ffn_hidden=14336 --set model.vocab_size=128256
       --set model.rope_theta=500000 --set model.max_seq_len=8192 --set data.seq_len=4096
       --set train.micro_batch=1 --set train.grad_accum=1 --set run.name=gpu-llama3-8b)
run bench-8b-selective 240 "$PY" "${BENCH[@]}" "${L3_8B[@]}" --set parallel.activation_checkpoint=selective \
  || run bench-8b-full 240 "$PY" "${BENCH[@]}" "${L3_8B[@]}" --set parallel.activation_checkpoint=full || true

if "$PY" -m llmcluster validate --help 2>/dev/null | grep -q compute; then
    run validate 120 "$PY" -m llmcluster validate compute memory --json || true
else
    log "llmcluster validate compute: not in this tree, skipped"
fi

log "summary"
grep -h "MFU\|bench \|tokens/s\|peak memory" "$OUT"/bench-*.log 2>/dev/null || true
cp -r "$OUT/storage/logs/bench" "$OUT/bench-records" 2>/dev/null || true
exit $STATUS
