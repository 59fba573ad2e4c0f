#!/usr/bin/env bash
# One-GPU check of the CUDA training path, in one go and under 8 minutes on an H100/H200-class GPU:
#   1. the pytest tests that need CUDA (tests/test_gpu.py: NCCL, FSDP bf16 policy, fused AdamW, HF parity)
#      and the compat/control-collective tests;
#   2. `validate stack compute memory --quick`: bf16 matmul TFLOP/s and HBM GB/s against the datasheet;
#   3. `bench` MFU on a Llama-3-8B-width model (d 4096, 32 heads / 8 kv, ffn 14336, vocab 128256, seq 4096)
#      with 16 of its 32 layers: 4.54B params, whose fp32 weights + grads + AdamW state (16 B/param, 73 GB)
#      leave an H200 (141 GB) room for the activations; the whole 8.03B (128 GB of state) would not.
#      FSDP on one rank (the bf16 MixedPrecisionPolicy path), torch.compile per block, selective AC;
#   4. a training loop with torch.compile and activation checkpointing that checkpoints, then a second run
#      that resumes from that checkpoint and finishes.
#
#   bash benchmarks/gpu_check.sh                 # on the GPU machine; everything under $WORK
#   bash benchmarks/gpu_check.sh --cpu-smoke     # the same steps on CPU with tiny shapes (a test runs this)
#   bash benchmarks/gpu_check.sh --fetch-wheels  # on a machine with a registry: the packages a machine
#                                                # without one lacks, as Python 3.12 wheels into .whl/
#
# Python: $PYTHON if set; else the first of .venv/bin/python, python3 whose torch works here (sees CUDA on
# the GPU run). Missing Python packages (the H200 test machine has no pydantic) come from .whl/ without a
# network. Only where no torch sees the GPU and a registry answers does it build .venv-gpu with the torch
# whose CUDA build the driver runs (llmcluster/floor.py: torch_for_driver), never an unpinned `pip install torch`.
# Each step has a time limit and the whole run a budget ($GPU_CHECK_BUDGET_S, default 450 s); a failed step is
# reported and the rest still run; the exit status is 1 if any failed. If $OUT is set (the device machine's
# folder that comes back), the log, the JSON report and the bench records are copied there.
set -uo pipefail

MODE=gpu
case "${1:-}" in
    "") ;;
    --cpu-smoke) MODE=cpu ;;
    --fetch-wheels) MODE=fetch ;;
    *) echo "usage: bash benchmarks/gpu_check.sh [--cpu-smoke | --fetch-wheels]" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."
REPO=$PWD
# The Python packages llmcluster needs that the H200 test machine lacks (pydantic and its own dependencies).
WHEELS=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
        typing-extensions==4.16.0)

if [[ $MODE == fetch ]]; then
    mkdir -p .whl
    for w in "${WHEELS[@]}"; do
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            -d .whl "$w" || exit 1
    done
    ls .whl
    exit 0
fi

WORK=${GPU_CHECK_WORK:-$REPO/gpu-check-out}
mkdir -p "$WORK"
exec > >(tee "$WORK/gpu_check.log") 2>&1
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 COLUMNS=${COLUMNS:-160}  # rich tables in a log: one row per line
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$WORK/inductor-cache}
export LLMCLUSTER_STORAGE=$WORK/storage
BUDGET=${GPU_CHECK_BUDGET_S:-450}
STATUS=0
FAILED=()

log() { printf '\n=== %s  [%s, %ss]\n' "$*" "$(date +%H:%M:%S)" "$SECONDS"; }

copy_out() {
    [[ -n ${OUT:-} && -d ${OUT:-} ]] || return 0
    cp "$WORK/gpu_check.log" "$WORK/validate.json" "$OUT/" 2>/dev/null
    cat "$WORK"/storage/logs/bench/*.json > "$OUT/bench-records.json" 2>/dev/null
    true
}
trap copy_out EXIT

torch_ok() {  # PY: its torch imports (and sees a GPU on the GPU run)
    local want=$([[ $MODE == gpu ]] && echo "torch.cuda.is_available()" || echo True)
    "$1" -c "import sys, torch; sys.exit(0 if $want else 1)" 2>/dev/null
}

registry_up() { timeout 15 python3 -m pip download -q --no-deps -d "$WORK/.probe" six >/dev/null 2>&1; }

pick_python() {
    if [[ -n ${PYTHON:-} ]]; then echo "$PYTHON"; return; fi
    local py
    for py in "$REPO/.venv/bin/python" "$(command -v python3 || true)"; do
        if [[ -n $py && -x $py ]] && torch_ok "$py"; then echo "$py"; return; fi
    done
    [[ $MODE == gpu ]] || { echo "error: no python with torch found" >&2; return 1; }
    local driver pin
    driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)
    [[ -n $driver ]] || { echo "error: no python's torch sees a GPU and nvidia-smi finds no driver" >&2; return 1; }
    pin=$(python3 -c "import sys; sys.path.insert(0, '$REPO/llmcluster');
from floor import torch_for_driver; print(torch_for_driver('$driver') or '')")
    [[ -n $pin ]] || { echo "error: driver $driver is older than any supported torch's CUDA build" >&2; return 1; }
    registry_up || { echo "error: no torch here sees the GPU, and no registry to install torch==$pin from" >&2; return 1; }
    echo "installing torch==$pin (its registry wheel's CUDA build runs on driver $driver) into .venv-gpu" >&2
    python3 -m venv "$REPO/.venv-gpu" >&2 && "$REPO/.venv-gpu/bin/pip" install -q "torch==$pin" -e "$REPO" >&2 \
        || return 1
    echo "$REPO/.venv-gpu/bin/python"
}

PY=$(pick_python) || exit 1
log "python: $PY ($MODE)"
MISSING=$("$PY" - <<'EOF'
import importlib.util
need = ["pydantic", "yaml", "rich", "pytest", "pytest_timeout", "tokenizers", "safetensors", "numpy"]
print(" ".join(n for n in need if importlib.util.find_spec(n) is None))
EOF
)
if [[ -n $MISSING ]]; then
    if compgen -G "$REPO/.whl/*.whl" >/dev/null; then
        echo "missing: $MISSING: installing the carried wheels from .whl/ into $WORK/site (no network)"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
            "$REPO"/.whl/*.whl && export PYTHONPATH=$PYTHONPATH:$WORK/site
    elif registry_up; then
        "$PY" -m pip install -q pydantic pyyaml rich pytest pytest-timeout tokenizers safetensors numpy
    else
        echo "error: missing Python packages ($MISSING), no .whl/ and no registry:" \
             "run 'bash benchmarks/gpu_check.sh --fetch-wheels' on a machine with one" >&2
        exit 1
    fi
fi

"$PY" - "$MODE" <<'EOF' || exit 1
import sys, torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPU available {torch.cuda.is_available()}")
if sys.argv[1] == "gpu":
    assert torch.cuda.is_available(), "no CUDA device visible to torch"
    p = torch.cuda.get_device_properties(0)
    print(f"GPU 0: {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs")
EOF
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit \
    --format=csv 2>/dev/null

# run NAME LIMIT_S CMD...: within the step's limit and what is left of the budget; failures are counted.
run() {
    local name=$1 limit=$2; shift 2
    local left=$((BUDGET - SECONDS))
    if (( left < 15 )); then
        echo "!!! $name skipped: the ${BUDGET}s budget is spent"; STATUS=1; FAILED+=("$name (no time)"); return 1
    fi
    (( limit > left )) && limit=$left
    log "$name (limit ${limit}s)"
    local rc=0
    timeout --signal=TERM --kill-after=10 "$limit" "$@" 2>&1 | tee "$WORK/$name.log" || rc=${PIPESTATUS[0]}
    if [[ $rc -ne 0 ]]; then
        echo "!!! $name failed (exit $rc; 124 = over its limit)"; STATUS=1; FAILED+=("$name")
    fi
    return $rc
}

LLMC=("$PY" -m llmcluster)
if [[ $MODE == gpu ]]; then
    DEVICE=cuda COMPILE=true STEPS=6 WARMUP=3 TESTS=(tests/test_gpu.py tests/test_compat.py)
    # Llama-3-8B widths, 16 of its 32 layers (see the header); seq 4096, one sequence per step.
    BENCH_MODEL=(--config llm_7b --set model.n_layers=16 --set model.d_model=4096 --set model.n_heads=32
                 --set model.n_kv_heads=8 --set model.ffn_hidden=14336 --set model.vocab_size=128256
                 --set model.rope_theta=500000 --set model.max_seq_len=8192 --set data.seq_len=4096
                 --set train.micro_batch=1 --set train.grad_accum=1)
    TRAIN_SHAPE=(--set model.n_layers=8 --set model.d_model=1024 --set model.n_heads=16 --set model.n_kv_heads=4
                 --set model.ffn_hidden=2816 --set data.seq_len=512 --set train.micro_batch=16)
else
    DEVICE=cpu COMPILE=false STEPS=2 WARMUP=1 TESTS=(tests/test_gpu.py)  # the suite runs test_compat
    BENCH_MODEL=(--config llm_tiny --set model.n_layers=2 --set model.d_model=64 --set model.n_heads=4
                 --set model.n_kv_heads=2 --set model.ffn_hidden=128 --set data.seq_len=64 --set train.micro_batch=2)
    TRAIN_SHAPE=(--set model.n_layers=2 --set model.d_model=64 --set model.n_heads=4 --set model.n_kv_heads=2
                 --set model.ffn_hidden=128 --set data.seq_len=64 --set train.micro_batch=4)
fi

# 1. tests
run pytest 150 "$PY" -m pytest -q -rs -p no:cacheprovider "${TESTS[@]}"

# 2. device figures against the datasheet (JSON report in $WORK/validate.json)
run validate 90 "${LLMC[@]}" validate stack compute memory --quick --report "$WORK/validate.json" --root "$WORK/storage"

# 3. bench MFU: torchrun with one rank (FSDP's MixedPrecisionPolicy path), bf16, compile, selective AC
run bench 200 "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 -m llmcluster bench \
    "${BENCH_MODEL[@]}" --steps "$STEPS" --warmup "$WARMUP" --root "$WORK/storage" \
    --set run.name=gpu-check-bench --set train.device=$DEVICE --set train.precision=bf16 \
    --set train.compile=$COMPILE --set parallel.dp_shard=-1 --set parallel.dp_replicate=1 \
    --set parallel.activation_checkpoint=selective

# 4. train with compile + AC, checkpoint at step 10, then resume from it to step 20
"${LLMC[@]}" storage init --root "$WORK/storage" >/dev/null
if [[ ! -f $WORK/storage/datasets/code/gpucheck/meta.json ]]; then
    STDLIB=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
    run data 60 "${LLMC[@]}" data prepare --root "$WORK/storage" --name gpucheck --source "$STDLIB/json" \
        "$STDLIB/email" --tokenizer byte --val-fraction 0.1
fi
rm -rf "$WORK/storage/checkpoints/gpu-check-train" "$WORK/storage/logs/gpu-check-train"
TRAIN=("${LLMC[@]}" train --config llm_tiny --root "$WORK/storage" "${TRAIN_SHAPE[@]}"
       --set run.name=gpu-check-train --set data.dataset=gpucheck --set model.vocab_size=257
       --set train.device=$DEVICE --set train.precision=bf16 --set train.compile=$COMPILE
       --set parallel.activation_checkpoint=selective --set parallel.dp_replicate=1
       --set checkpoint.interval_steps=10 --set log.interval=5 --set log.eval_interval=10
       --set log.eval_batches=2 --set log.progress=false)
run train 120 "${TRAIN[@]}" --set train.steps=10
run resume 120 "${TRAIN[@]}" --set train.steps=20
grep -q "resumed from .*step_10" "$WORK/resume.log" 2>/dev/null \
    || { echo "!!! resume did not start from step_10"; STATUS=1; FAILED+=("resume-from-step_10"); }

log "summary ($MODE, ${SECONDS}s)"
grep -h "passed\|failed\|skipped" "$WORK/pytest.log" 2>/dev/null | tail -1
grep -h "TFLOP/s\|GB/s" "$WORK/validate.log" 2>/dev/null | head -6
grep -h "^bench \|MFU\|step time\|peak memory" "$WORK/bench.log" 2>/dev/null
grep -h "resumed from\|finished step" "$WORK/train.log" "$WORK/resume.log" 2>/dev/null
if (( STATUS )); then echo "FAILED: ${FAILED[*]}"; else echo "gpu_check: all steps passed"; fi
exit $STATUS
