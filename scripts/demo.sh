#!/usr/bin/env bash
# The main job on the embedded default: storage init -> data prepare (the stdlib's own source) ->
# 2-rank training of llm_tiny on CPU -> export to Hugging Face format -> a generated sample.
# Run again and it resumes (or finds the run finished) instead of starting over.
# Extra arguments go to `train`, e.g. `bash scripts/demo.sh --set train.precision=fp32`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
LLMC="$VENV/bin/llmcluster"
ROOT=${LLMCLUSTER_STORAGE:-./storage}
NPROC=${NPROC:-2}
CONFIG=configs/llm_tiny.yaml
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
T0=$SECONDS

step "1/5 storage layout under $ROOT"
"$LLMC" storage init --root "$ROOT"

step "2/5 dataset: the Python standard library's source, byte-level BPE"
if [ -f "$ROOT/datasets/code/stdlib/meta.json" ]; then
  echo "dataset already prepared: $ROOT/datasets/code/stdlib"
else
  "$LLMC" data prepare --root "$ROOT" --name stdlib --kind code
fi

step "3/5 training llm_tiny with $NPROC ranks (gloo, CPU)"
# The run's name (`--set run.name=...` trains, exports and samples another run). Which precision this machine
# computes in, and why, the trainer says once (bf16 where the CPU has native bf16, else fp32).
RUN=$("$VENV/bin/python" - "$CONFIG" "$@" <<'PY'
import sys
from llmcluster.config.load import load_job_config
args = sys.argv[2:]
cfg = load_job_config(sys.argv[1], [a for i, a in enumerate(args) if i and args[i - 1] == "--set"])
print(cfg.run.name)
PY
)
# --procs-per-node: the ranks started by torch's elastic launch inside llmcluster (torchrun --standalone's), which
# exits with the ranks' own code and line: Ctrl-C checkpoints and exits 75, bad input is one line and 2.
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$LLMC" train --procs-per-node "$NPROC" --config "$CONFIG" --root "$ROOT" "$@"

step "4/5 export to Hugging Face Llama format"
"$LLMC" export --run "$RUN" --root "$ROOT"

step "5/5 a sample (prompt: 'import os')"
"$LLMC" generate --model "$RUN" --root "$ROOT" --prompt "import os" --max-new-tokens 150 --temperature 0.7 --top-k 40 --seed 1

step "where everything went"
"$LLMC" storage status --root "$ROOT"
cat <<MSG
  dataset      $ROOT/datasets/code/stdlib/   (token shards, tokenizer.json, meta.json)
  checkpoints  $ROOT/checkpoints/$RUN/step_<N>/
  metrics      $ROOT/logs/$RUN/metrics.jsonl
  model        $ROOT/models/$RUN/   (load with transformers.AutoModelForCausalLM.from_pretrained)
  demo took    $((SECONDS - T0)) s
next: \`source $VENV/bin/activate\` puts llmcluster on your PATH (or type $LLMC); the README's worked examples
continue from here, with this storage root ($ROOT) and the run $RUN.
MSG
