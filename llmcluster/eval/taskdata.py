"""A task YAML file read as data (issue 32): only the keys the shipped tasks use, with values of the shapes they
use, `include` resolved here, and one fully-resolved YAML (no include) handed to the harness.

Why an allowlist and not a denylist: lm-evaluation-harness runs code from a task file in more ways than the
`!function` tag — it follows `include:` with its own loader (whose `!function` imports a module beside the
included file), renders `doc_to_*` with an unsandboxed Jinja environment (`{{ cycler.__init__.__globals__.os
.popen(...) }}`), loads an unknown metric name with `evaluate.load` (a local script), and hands `dataset_path`
to `datasets.load_dataset` (a local loading script). What the shipped tasks use is small, data-only, and
checked value by value below; anything else is refused in one line naming the file and key. The harness's own
registry tasks (`--tasks arc_easy`: YAML and Python inside its installed package) are trusted as its code is.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from llmcluster.config import strict_yaml
from llmcluster.errors import UserError

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*", re.ASCII)
_FIELD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*", re.ASCII)
# A template: text with plain `{{ field }}` substitutions and nothing else Jinja reads. Text is any character but
# `{`, or a `{` not opening `{{`, `{%` or `{#` (so `{{{ x }}` does not pass as "{" + "{{ x }}": Jinja reads it
# from the first brace); whitespace control (`{{- x }}`), filters, attributes and calls are all refused.
_TEMPLATE = re.compile(r"(?:[^{]|\{(?![{%#])|\{\{[ \t]*[A-Za-z_][A-Za-z0-9_]*[ \t]*\}\})*", re.ASCII)

# lm-eval's own registered metrics and aggregations (lm_eval/api/metrics.py, 0.4.13): any other name is loaded
# with `evaluate.load(name)`, which runs a local metric script.
METRICS = {"acc", "acc_all", "acc_bytes", "acc_mutual_info", "acc_norm", "bits_per_byte", "bleu", "brier_score",
           "byte_perplexity", "chrf", "exact_match", "likelihood", "mcc", "perplexity", "ter", "word_perplexity"}
AGGREGATIONS = {"bits_per_byte", "bleu", "brier_score", "chrf", "matthews_corrcoef", "mean", "median", "nanmean",
                "perplexity", "ter", "weighted_perplexity"}
OUTPUT_TYPES = {"loglikelihood", "loglikelihood_rolling", "generate_until", "multiple_choice"}
# `datasets`' packaged builders for plain files: a dataset_path that is a directory or a hub name could bring a
# loading script.
DATASET_BUILDERS = {"json", "csv", "parquet", "text"}


def _text(v) -> bool:
    return isinstance(v, str)


def _template(v) -> bool:
    return isinstance(v, str) and bool(_TEMPLATE.fullmatch(v))


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _data_files(v) -> bool:
    def paths(x):
        return _text(x) or (isinstance(x, list) and all(_text(p) for p in x))
    return paths(v) or (isinstance(v, dict) and all(_FIELD.fullmatch(str(k)) and paths(p) for k, p in v.items()))


def _metric_list(v) -> bool:
    ok = {"metric": lambda m: m in METRICS, "aggregation": lambda a: a in AGGREGATIONS,
          "higher_is_better": lambda b: isinstance(b, bool)}
    return isinstance(v, list) and all(isinstance(m, dict) and "metric" in m and
                                       all(k in ok and ok[k](x) for k, x in m.items()) for m in v)


def _generation_kwargs(v) -> bool:
    ok = {"until": lambda u: isinstance(u, list) and all(_text(s) for s in u),
          "max_gen_toks": lambda n: isinstance(n, int) and not isinstance(n, bool) and n > 0,
          "do_sample": lambda b: isinstance(b, bool)}
    return isinstance(v, dict) and all(k in ok and ok[k](x) for k, x in v.items())


# The keys of the shipped tasks (llmcluster/assets/eval_tasks/*.yaml), each with the shape of value accepted and
# what the error says it must be. `include` is resolved before these checks (never handed to the harness).
ALLOWED = {
    "task": (lambda v: _text(v) and bool(_NAME.fullmatch(v)), "a task name"),
    "dataset_path": (lambda v: v in DATASET_BUILDERS, "one of " + ", ".join(sorted(DATASET_BUILDERS))),
    "dataset_kwargs": (lambda v: isinstance(v, dict) and set(v) <= {"data_files"} and
                       _data_files(v.get("data_files", [])), "{data_files: PATH or {SPLIT: PATH}}"),
    "test_split": (lambda v: _text(v) and bool(_FIELD.fullmatch(v)), "a split name"),
    "output_type": (lambda v: v in OUTPUT_TYPES, "one of " + ", ".join(sorted(OUTPUT_TYPES))),
    "doc_to_text": (_template, "a field name or a text with plain {{ field }} substitutions"),
    "doc_to_target": (lambda v: _template(v) or (isinstance(v, int) and not isinstance(v, bool)),
                      "a field name, an index or a text with plain {{ field }} substitutions"),
    "doc_to_choice": (lambda v: _template(v) or (isinstance(v, list) and all(_template(c) for c in v)),
                      "a field name, a list of texts, or a text with plain {{ field }} substitutions"),
    "target_delimiter": (_text, "a string"),
    "should_decontaminate": (lambda v: isinstance(v, bool), "true or false"),
    "generation_kwargs": (_generation_kwargs, "{until: [TEXT], max_gen_toks: N, do_sample: BOOL}"),
    "metric_list": (_metric_list, "a list of {metric, aggregation, higher_is_better} with lm-eval's own metric "
                                  "(" + ", ".join(sorted(METRICS)) + ") and aggregation names"),
    "metadata": (lambda v: isinstance(v, dict) and set(v) <= {"version", "chance"} and
                 all(_number(x) for x in v.values()), "{version: N, chance: N}"),
}


def _read(path: Path, shown: str) -> dict:
    try:
        doc = strict_yaml.load(path.read_text())
    except strict_yaml.DuplicateKey as e:
        raise UserError(f"--tasks {shown}: {e.problem}") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:   # a `!function` tag lands here
        first = str(e).splitlines()[0] if str(e) else ""
        raise UserError(f"--tasks {shown}: not a task YAML we can read as data ({type(e).__name__}: {first})") \
            from None
    if not isinstance(doc, dict):
        raise UserError(f"--tasks {shown}: not a task YAML (a mapping of keys) we can read as data")
    return doc


def load(path: Path, shown: str | None = None, _stack: tuple[Path, ...] = ()) -> dict:
    """The task file at `path`, its includes merged in (an included file first, the including file's keys over
    it, as the harness merges them), every key checked; the result has no `include`."""
    shown = shown or str(path)
    real = path.resolve()
    if real in _stack:
        raise UserError(f"--tasks {shown}: include cycle ({' -> '.join(str(p) for p in (*_stack, real))})")
    doc = _read(path, shown)
    include = doc.pop("include", None)
    merged: dict = {}
    if include is not None:
        names = include if isinstance(include, list) else [include]
        if not names or not all(_text(n) and n.endswith((".yaml", ".yml")) for n in names):
            raise UserError(f"--tasks {shown}: key 'include' must name task YAML files (.yaml/.yml)")
        for n in names:
            inc = Path(n) if Path(n).is_absolute() else path.parent / n   # relative to the including file
            if not inc.is_file():
                raise UserError(f"--tasks {shown}: key 'include': no such task file {inc}")
            merged.update(load(inc, str(inc), (*_stack, real)))
    for key, value in doc.items():
        check = ALLOWED.get(key) if isinstance(key, str) else None
        if check is None:
            raise UserError(f"--tasks {shown}: key {key!r} is not accepted in a task file (read as data; "
                            f"accepted: include, {', '.join(ALLOWED)})")
        if not check[0](value):
            raise UserError(f"--tasks {shown}: key {key!r} must be {check[1]}, got {_short(value)}")
    merged.update(doc)
    return merged


def _short(value, limit: int = 80) -> str:
    r = repr(value)
    return r if len(r) <= limit else r[:limit] + "..."
