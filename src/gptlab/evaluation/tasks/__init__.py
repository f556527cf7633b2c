"""The lm-evaluation-harness tasks shipped with gptlab: one YAML and one JSON-lines file per task, their data
loaded by :mod:`gptlab.evaluation.tasks.task_data` (``eval_harness`` searches this folder; docs/evaluation.md)."""
