#!/usr/bin/env bash
# `make test`: the whole suite as two streams that run at once.
#   - the serial tests (marker `serial`, set by tests/conftest.py): those that share one thing the machine has
#     once, the real Slurm cluster or the session's vLLM server, one after the other in a pytest of their own.
#     They mostly wait: on the scheduler's clock (a time limit's signal comes 30-90 s in, requeues, a serving
#     job's health) or on a server (2026-12-06, a quiet 2-core machine: the Slurm ones ~480 s of wall for ~80 s
#     of their own CPU, the vLLM ones ~240 s for ~75 s). On one of the two xdist workers, as before, that
#     worker left a core idle for minutes. The two groups share nothing with each other: they run at once, each
#     on an xdist worker of this stream (`--dist loadgroup`), one test after the other inside a group. One after
#     the other in one process, this stream (1110-1202 s, 2026-12-07) was as long as the workers' own;
#   - everything else on WORKERS pytest-xdist workers (`--dist loadgroup`).
# The worker count is the Makefile's (3 on 2 cores since the OpenMP threads below wait passively: measured there);
# this stream adds only tests that wait. Each stream prints its own summary and slowest tests; the
# exit status is the first failure's. WORKERS=0 (a debugger): one process; a `-m` of the caller's: one stream on
# the workers.
#
#   bash scripts/test_suite.sh PYTHON WORKERS [PYTEST_ARGS...]
set -uo pipefail
# Three streams share two cores, and a CPU training in a test runs an OpenMP team per process: by default each idle
# OpenMP thread spins for its next task, burning the core another stream's process is waiting for. Measured
# (2026-12-07, 2 cores, two busy loops beside it): tests/test_qlora.py's three in-process trainings 28.1 s spinning,
# 14.7 s with passive waits (one CI run had it at 127 s). A user's own CPU run keeps OpenMP's default.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
PY=$1 WORKERS=$2
shift 2
if [[ $WORKERS == 0 ]]; then
    exec "$PY" -m pytest -q --durations=20 "$@"
fi
for a in "$@"; do   # the caller's own marker selection: one stream, on the workers
    [[ $a == -m* ]] && exec "$PY" -m pytest -q --durations=20 -n "$WORKERS" --dist loadgroup "$@"
done

log=$(mktemp -t llmcluster-serial-tests.XXXXXX.log)
# Each stream's JUnit XML and wall time feed the summary at the end (scripts/suite_summary.py): the machine's kind,
# each stream's time and its ten slowest tests, and every test's time in a TSV to compare machines side by side.
out=${TEST_SUITE_OUT:-$(mktemp -d -t llmcluster-suite.XXXXXX)}
mkdir -p "$out"
# no cache provider here: two sessions would write .pytest_cache/ at once (the main stream keeps --lf working)
(
    t0=$SECONDS
    "$PY" -m pytest -q --durations=10 -p no:cacheprovider -n 2 --dist loadgroup -m serial \
        --junitxml="$out/serial.xml" "$@" >"$log" 2>&1
    rc=$?
    echo $((SECONDS - t0)) >"$out/serial.seconds"
    exit $rc
) &
side=$!
trap 'kill "$side" 2>/dev/null' EXIT
t0=$SECONDS
"$PY" -m pytest -q --durations=20 -n "$WORKERS" --dist loadgroup -m "not serial" --junitxml="$out/workers.xml" "$@"
main_rc=$?
main_s=$((SECONDS - t0))
echo
echo "=== the serial tests (Slurm, the session's vLLM server), the stream beside the workers (also in $log):"
wait "$side"
side_rc=$?
trap - EXIT
cat "$log"
"$PY" "$(dirname "$0")/suite_summary.py" --tsv "$out/durations.tsv" \
    "workers ($WORKERS)=$main_s=$out/workers.xml" "serial (Slurm, vLLM)=$(cat "$out/serial.seconds" 2>/dev/null || echo 0)=$out/serial.xml"
# 5 is "no test collected": PYTEST_ARGS that name no test of one stream; both 5 is a selection of nothing
if (( main_rc == 5 && side_rc == 5 )); then exit 5; fi
for rc in "$main_rc" "$side_rc"; do
    (( rc != 0 && rc != 5 )) && exit "$rc"
done
exit 0
