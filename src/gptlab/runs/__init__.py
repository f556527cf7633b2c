"""A run: the directory one ``python train.py`` job writes, and everything that reads it back.

- :mod:`gptlab.runs.layout`: the names of the files and folders in a run directory (their one owner), finding
  run directories, and locating a run's last, best and preemption checkpoints (single files and sharded
  directories; the best ranked by the scores the run recorded).
- :mod:`gptlab.runs.resume`: a run's one entry into its directory (new or continued), the checkpoint a
  ``resume=`` continues from, and the checks that refuse an unusable one before training.
- :mod:`gptlab.runs.jsonfile`: the run directory's JSON files written as strict JSON (no NaN token), and
  their figures read back.
- :mod:`gptlab.runs.identity`: which run a directory holds (``run.json``) and the running process's claim.
- :mod:`gptlab.runs.checkpoints`: the one loader of checkpoints of every kind, tensors only.
- :mod:`gptlab.runs.digests`: the SHA-256 digest written beside each checkpoint and checked before it is read.
- :mod:`gptlab.runs.trained`: a trained model, its tokenizer and its validation tokens, rebuilt from a run.
- :mod:`gptlab.runs.naming`: a run's identity (name, group, tags) from the Hydra overrides that made it.

Resuming, the analysis of sweeps (:mod:`gptlab.comparison`) and the scripts read runs
only through this package. Importing it costs no torch: the loaders import it when called.
"""

from gptlab.runs.layout import (
    BEST_GLOB,
    CHECKPOINT_DIR,
    CONFIG_FILE,
    EVAL_LENGTH_DIR,
    HPC_GLOB,
    LAST_CHECKPOINT,
    LENGTH_FILE,
    RESULT_FILE,
    Run,
    find_run_dirs,
    run_of_path,
)

__all__ = [
    "BEST_GLOB",
    "CHECKPOINT_DIR",
    "CONFIG_FILE",
    "EVAL_LENGTH_DIR",
    "HPC_GLOB",
    "LAST_CHECKPOINT",
    "LENGTH_FILE",
    "RESULT_FILE",
    "Run",
    "find_run_dirs",
    "run_of_path",
]
