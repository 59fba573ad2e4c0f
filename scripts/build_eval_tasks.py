"""Build the shipped lm-evaluation-harness tasks under llmcluster/assets/eval_tasks/ (deterministic).

Source: the Python standard library of the interpreter running this script (its version and path go into
SOURCE.json). Only *held-out* files are used: those the demo's dataset puts in
its validation split (`data prepare` defaults: --seed 1337, --val-fraction 0.05, keyed by the file's absolute
path, as llmcluster.data.shards.is_val decides) and outside json/ and email/ (the test suite's `tiny` dataset
trains on those two packages whole). Rebuilt on another machine, a different stdlib path gives another split:
the shipped files are the ones recorded in SOURCE.json, which is what makes them held out for *this* layout.

    python scripts/build_eval_tasks.py            # rewrites llmcluster/assets/eval_tasks/

Three tasks, each a JSONL of records plus its YAML (`dataset_path: json`; `llmcluster eval` points
`data_files` at the shipped JSONL):
    llmc_stdlib_mc        multiple choice: 4 preceding lines -> which of 4 lines comes next (chance 1/4);
                          the 3 distractors are lines of nearly the same length from other held-out files
    llmc_stdlib_complete  generate_until: 4 preceding lines and the first part of a line -> the rest of it
    llmc_stdlib_ppl       loglikelihood_rolling over ~800-character pieces of held-out files
                          (bits_per_byte, byte_perplexity, word_perplexity)
"""

from __future__ import annotations

import json
import random
import sys
import sysconfig
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmcluster.data.prepare import STDLIB_DATA_DIRS  # noqa: E402
from llmcluster.data.shards import is_val  # noqa: E402
from llmcluster.data.sources import SKIP_DIRS, collect_units  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "llmcluster" / "assets" / "eval_tasks"
SEED, VAL_FRACTION = 1337, 0.05          # `data prepare`'s defaults: the demo's split
EXCLUDE = {"json", "email"}   # the tests' `tiny` dataset trains on these two packages whole
N_MC, N_COMPLETE, N_PPL = 150, 150, 100
CONTEXT_LINES = 4
PPL_CHARS = 800


def held_out_files(stdlib: Path) -> list[Path]:
    """The .py files `data prepare` (no --source) walks and keys exactly so, that its split puts in val."""
    units = collect_units([stdlib], "code", SKIP_DIRS | STDLIB_DATA_DIRS)
    return sorted(u.path for u in units if u.path.suffix == ".py" and is_val(str(u.path), SEED, VAL_FRACTION)
            and not set(u.path.relative_to(stdlib).parts[:-1]) & EXCLUDE)


def code_lines(text: str) -> list[str]:
    """Non-blank lines without trailing spaces; tabs and form feeds make tokenizers disagree: such files skip."""
    return [ln.rstrip() for ln in text.splitlines() if ln.strip()]


def line_chunks(text: str, size: int) -> list[str]:
    """`text` cut at line ends into pieces of at most about `size` characters."""
    out, cur = [], ""
    for ln in text.splitlines(keepends=True):
        if cur and len(cur) + len(ln) > size:
            out.append(cur)
            cur = ""
        cur += ln
    return out + [cur] if cur else out


def windows(files: list[tuple[str, list[str]]], rng: random.Random, lo: int, hi: int):
    """(file, context lines, next line) at random positions whose next line is lo..hi characters."""
    cands = [(name, lines, i) for name, lines in files for i in range(CONTEXT_LINES, len(lines))
             if lo <= len(lines[i]) <= hi and not lines[i].lstrip().startswith("#")]
    rng.shuffle(cands)
    return cands


def build(stdlib: Path) -> dict:
    rng = random.Random(SEED)
    files = []
    for p in held_out_files(stdlib):
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if "\t" in text or "\f" in text or not text.isascii():
            continue
        files.append((str(p.relative_to(stdlib)), code_lines(text), text))
    by_len: dict[int, list[tuple[str, str]]] = {}
    for name, lines, _ in files:
        for ln in lines:
            by_len.setdefault(len(ln), []).append((name, ln))

    mc, seen = [], set()
    for name, lines, i in windows([(n, ls) for n, ls, _ in files], rng, 12, 60):
        gold = lines[i]
        pool = sorted({ln for n, ln in (x for d in (-1, 0, 1) for x in by_len.get(len(gold) + d, []))
                       if n != name and ln.strip() != gold.strip()})
        if len(pool) < 3 or gold in seen:
            continue
        seen.add(gold)
        choices = rng.sample(pool, 3)
        label = rng.randrange(4)
        choices.insert(label, gold)
        mc.append({"context": "\n".join(lines[i - CONTEXT_LINES:i]) + "\n", "choices": choices, "label": label,
                   "source": name})
        if len(mc) == N_MC:
            break

    comp = []
    for name, lines, i in windows([(n, ls) for n, ls, _ in files], rng, 16, 60):
        line = lines[i]
        cut = len(line) - rng.randint(4, 10)
        prefix, rest = line[:cut], line[cut:]
        if not rest.strip() or (name, i) in seen:
            continue
        seen.add((name, i))
        comp.append({"context": "\n".join(lines[i - CONTEXT_LINES:i] + [prefix]), "target": rest,
                     "source": name})
        if len(comp) == N_COMPLETE:
            break

    chunks = [(name, c) for name, _, text in files for c in line_chunks(text, PPL_CHARS) if c.strip()]
    ppl = [{"text": c, "source": name} for name, c in rng.sample(chunks, min(N_PPL, len(chunks)))]
    return {"llmc_stdlib_mc": mc, "llmc_stdlib_complete": comp, "llmc_stdlib_ppl": ppl,
            "_files": sorted(n for n, _, _ in files)}


YAMLS = {
    "llmc_stdlib_mc": """\
# Multiple choice: which of 4 lines follows 4 lines of held-out stdlib code (chance 0.25).
# Built by scripts/build_eval_tasks.py; `llmcluster eval` points data_files at the shipped JSONL.
task: llmc_stdlib_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: llmc_stdlib_mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
  chance: 0.25
""",
    "llmc_stdlib_complete": """\
# Code completion: the rest of a line of held-out stdlib code, greedy, exact match.
# Built by scripts/build_eval_tasks.py; `llmcluster eval` points data_files at the shipped JSONL.
task: llmc_stdlib_complete
dataset_path: json
dataset_kwargs:
  data_files:
    test: llmc_stdlib_complete.jsonl
test_split: test
output_type: generate_until
doc_to_text: context
doc_to_target: target
target_delimiter: ""
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 16
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
""",
    "llmc_stdlib_ppl": """\
# Perplexity: ~800-character pieces (cut at line ends) of held-out stdlib files, scored token by token (rolling windows).
# Built by scripts/build_eval_tasks.py; `llmcluster eval` points data_files at the shipped JSONL.
task: llmc_stdlib_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: llmc_stdlib_ppl.jsonl
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: text
should_decontaminate: false
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
""",
}


def main() -> None:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    tasks = build(stdlib)
    OUT.mkdir(parents=True, exist_ok=True)
    for name, yml in YAMLS.items():
        (OUT / f"{name}.yaml").write_text(yml)
        with open(OUT / f"{name}.jsonl", "w") as f:
            for rec in tasks[name]:
                f.write(json.dumps(rec, sort_keys=True) + "\n")
        print(f"{name}: {len(tasks[name])} items", file=sys.stderr)
    (OUT / "SOURCE.json").write_text(json.dumps({
        "built_by": "scripts/build_eval_tasks.py", "python": sys.version.split()[0], "stdlib": str(stdlib),
        "split": {"seed": SEED, "val_fraction": VAL_FRACTION, "excluded_dirs": sorted(EXCLUDE | STDLIB_DATA_DIRS)},
        "held_out_files": tasks["_files"]}, indent=1) + "\n")


if __name__ == "__main__":
    main()
