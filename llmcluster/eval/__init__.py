"""Downstream evaluation with EleutherAI's lm-evaluation-harness (issue 28).

tasks.py    the shipped local tasks (assets/eval_tasks) and `--tasks` resolution, with a digest per task
harness.py  the harness's command line in its own venv, run fully offline, and its results JSON
evaluate.py what is evaluated (an export, a checkpoint step exported to a temporary directory, an endpoint)
            and where the results go: logs/<run>/eval/step_<N>/ and one line in logs/<run>/eval.jsonl
compare.py  `eval --compare`: a table across runs and checkpoints, scores plotted against tokens
"""
