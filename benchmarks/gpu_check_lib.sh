# Shared by benchmarks/gpu_check.sh and gpu_check_multi.sh (sourced, not run): the step budget, the step runner,
# the choice of Python. The caller sets MODE (gpu|cpu), WORK, STEP_ORDER, LIMIT (assoc) and SLACK first.

# print_budget MAX: each step's limit in running order and their sum; refuse a table over MAX seconds.
print_budget() {
    local s total=0
    echo "budget per step (s, GPU run):"
    for s in "${STEP_ORDER[@]}"; do printf '  %-12s %4d\n' "$s" "${LIMIT[$s]}"; total=$((total + LIMIT[$s])); done
    printf '  %-12s %4d  (limit %d)\n' total "$total" "$1"
    (( total <= $1 )) || { echo "error: the step budgets add up to ${total}s > $1s" >&2; return 2; }
}

# run NAME CMD...: under the step's limit (times $SLACK on CPU); its status and seconds go to WORK/steps.tsv.
STATUS=0
FAILED=()
run() {
    local name=$1; shift
    local limit=$((LIMIT[$name] * SLACK)) t0=$SECONDS rc=0 st=pass
    printf '\n=== %s (limit %ss)  [%s, %ss]\n' "$name" "$limit" "$(date +%H:%M:%S)" "$SECONDS"
    timeout --signal=TERM --kill-after=5 "$limit" "$@" 2>&1 | tee "$WORK/$name.log" || rc=${PIPESTATUS[0]}
    if (( rc )); then
        st=$([[ $rc == 124 || $rc == 137 ]] && echo timeout || echo fail)
        echo "!!! $name: $st (exit $rc)"; STATUS=1; FAILED+=("$name")
    fi
    printf '%s\t%s\t%s\t%s\n' "$name" "$st" "$((SECONDS - t0))" "${LIMIT[$name]}" >> "$WORK/steps.tsv"
    return $rc
}

# mark_failed NAME WHY: a step that exited 0 but whose output says it did not do its job.
mark_failed() {
    echo "!!! $1: $2"; STATUS=1; FAILED+=("$1 ($2)")
    sed -i "s/^$1\tpass/$1\tfail/" "$WORK/steps.tsv"
}

# pick_python: $PYTHON, else the first of .venv/bin/python, python3 whose torch works (sees CUDA on the GPU run).
pick_python() {
    local p want=$([[ $MODE == gpu ]] && echo "torch.cuda.is_available()" || echo True)
    for p in ${PYTHON:-} "$REPO/.venv/bin/python" "$(command -v python3 || true)"; do
        if [[ -n $p && -x $p ]] && timeout 60 "$p" -c "import sys, torch; sys.exit(0 if $want else 1)" 2>/dev/null
        then echo "$p"; return 0; fi
        [[ -n ${PYTHON:-} ]] && break   # an explicit choice that does not work is an error, not a fallback
    done
    [[ $MODE == gpu && -z ${PYTHON:-} ]] && torch_for_driver && return 0
    echo "error: no python whose torch works$([[ $MODE == gpu ]] && echo ' and sees a GPU')" >&2
    return 1
}

# torch_for_driver: where no torch sees the GPU and a registry answers, a .venv-gpu with the torch whose CUDA
# build this driver runs (llmcluster/floor.py), never an unpinned `pip install torch`.
torch_for_driver() {
    local driver pin
    driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)
    [[ -n $driver ]] || return 1
    pin=$(python3 -c "import sys; sys.path.insert(0, '$REPO/llmcluster')
from floor import torch_for_driver; print(torch_for_driver('$driver') or '')") || return 1
    [[ -n $pin ]] || { echo "error: driver $driver is older than any supported torch's CUDA build" >&2; return 1; }
    timeout 15 python3 -m pip download -q --no-deps -d "$WORK/.probe" six >/dev/null 2>&1 || return 1
    echo "installing torch==$pin (its registry wheel's CUDA build runs on driver $driver) into .venv-gpu" >&2
    python3 -m venv "$REPO/.venv-gpu" >&2 && "$REPO/.venv-gpu/bin/pip" install -q "torch==$pin" -e "$REPO" >&2 \
        && echo "$REPO/.venv-gpu/bin/python"
}

# prepare_data: a byte-level dataset from the standard library's own sources (no download), once per WORK.
prepare_data() {
    "$PY" -m llmcluster storage init --root "$WORK/storage" >/dev/null
    if [[ -f $WORK/storage/datasets/code/gpucheck/meta.json ]]; then
        printf 'data\tpass\t0\t%s\n' "${LIMIT[data]}" >> "$WORK/steps.tsv"; return 0
    fi
    local stdlib
    stdlib=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
    run data "$PY" -m llmcluster data prepare --root "$WORK/storage" --name gpucheck --source "$stdlib/json" \
        "$stdlib/email" --tokenizer byte --val-fraction 0.1
}

# copy_out LOG: the log and the JSON summary into $OUT (the device machine's folder that comes back), if set;
# the performance mode's summary as perf_summary.json, beside the correctness run's of the same call.
copy_out() {
    [[ -n ${OUT:-} && -d ${OUT:-} ]] || return 0
    cp "$WORK/$1" "$OUT/" 2>/dev/null
    cp "$WORK/summary.json" "$OUT/$( ((${PERF:-0})) && echo perf_)summary.json" 2>/dev/null
    true
}
