"""What `python train.py` says before it trains anything: its help page, and its refusals of a mistyped
choice or a bad value, which come before the heavy imports and leave no run folder behind."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from conftest import CONF, ROOT


def train_py(*args: str, cwd=ROOT, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -X importtime train.py <args>`: its output, and (in stderr) every module it imported."""
    return subprocess.run(
        [sys.executable, "-X", "importtime", str(ROOT / "train.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def imported(stderr: str) -> set[str]:
    """The top-level packages named in ``-X importtime``'s lines."""
    return {
        line.rsplit("|", 1)[1].strip().split(".")[0]
        for line in stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }


def without_import_times(stderr: str) -> str:
    return "\n".join(line for line in stderr.splitlines() if not line.startswith("import time:"))


def choices(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


# ---- --help ----------------------------------------------------------------------------------------------


def test_help_lists_the_groups_their_choices_the_examples_and_the_manual(tmp_path):
    proc = train_py("--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    page = proc.stdout
    assert page.startswith("gptlab:") and "powered by Hydra" not in page
    for group, listed in help_groups(page).items():
        assert listed == choices(group), group
    assert set(help_groups(page)) == {p.name for p in CONF.iterdir() if p.is_dir() and p.name != "hydra"}
    # Hydra's launchers: gptlab's own (conf/hydra/launcher) and the installed plugins' basic one
    launchers = re.search(r"^hydra/launcher: .*\n    (.*)$", page, re.M)
    assert launchers is not None, page
    assert {"basic", *choices("hydra/launcher")} <= set(launchers.group(1).split(", "))
    for example in (
        "python train.py model=small pos=sinusoidal activation=swiglu",
        "python train.py -m pos=learned,rope,alibi seed=0,1",
        "python train.py model=small pos=sinusoidal resume=auto",
        "python train.py model=small pos=rope --cfg job",
        "python scripts/compare.py outputs/multirun/",
    ):
        assert example in page
    assert "--multirun,-m" in page and "--cfg,-c" in page  # Hydra's flags
    assert "docs/index.md" in page and "--hydra-help" in page
    # a page, not a run: nothing heavy is imported and no run folder is made
    assert not {"torch", "lightning", "wandb"} & imported(proc.stderr)
    assert list(tmp_path.iterdir()) == []


def help_groups(page: str) -> dict[str, list[str]]:
    """The help page's config groups: each group's choices (its line below the group's own, wrapped), the
    marked one without its mark."""
    section = page.split("== Config groups", 1)[1].split("\nhydra/launcher:", 1)[0]
    groups: dict[str, list[str]] = {}
    for line in section.splitlines()[1:]:
        if not line.startswith(" "):
            group = line.split(":", 1)[0]
            groups[group] = []
        else:
            groups[group] += [c.strip().rstrip("*") for c in line.split(",") if c.strip()]
    return groups


def test_help_says_what_each_group_swaps_and_marks_the_choices_the_command_takes(tmp_path):
    from gptlab.cli import GROUP_SUMMARIES

    page = train_py("pos=rope", "task=word2vec", "compile=false", "--help", cwd=tmp_path).stdout
    for group in help_groups(page):
        assert f"\n{group}: {GROUP_SUMMARIES[group]}\n" in page, (
            f"conf/{group}/ has no line in GROUP_SUMMARIES"
        )
    assert set(GROUP_SUMMARIES) == set(help_groups(page)), "a GROUP_SUMMARIES line for a group conf/ lacks"
    assert "alibi, fire, learned, nope, relative, rope*, sinusoidal, xpos\n" in page
    assert "    char, gpt2*, word\n" in page  # the default, where the command chose nothing
    assert "\ntask: gpt, word2vec*\n" in page and "\ncompile: auto, true, false*\n" in page
    assert "\nloss.impl: auto*, chunked, torch, plain, liger, cce\n" in page
    assert max(len(line) for line in page.split("== Examples ==")[0].splitlines()) <= 110


def test_the_help_pages_choices_made_by_a_key_are_those_the_code_takes():
    """The values the help page lists for a key are those its parser accepts, in the order it lists them."""
    import typing

    from gptlab.cli import KEY_CHOICES
    from gptlab.model.config import NORM_PLACEMENTS
    from gptlab.model.head_loss import IMPLEMENTATIONS
    from gptlab.tasks import TASKS
    from gptlab.training.optimizers import AdamWOptions

    schedules = typing.get_args(typing.get_type_hints(AdamWOptions)["schedule"])
    taken = {
        "task": tuple(TASKS),
        "loss.impl": IMPLEMENTATIONS,
        "norm.placement": NORM_PLACEMENTS,
        "optim.schedule": schedules,
        "compile": ("auto", "true", "false"),
        "data.path": (),
        "data.name": (),
    }
    assert {choice.key: choice.values for choice in KEY_CHOICES} == taken


def test_the_help_pages_examples_compose(make_cfg):
    page = train_py("--help").stdout
    examples = re.findall(r"^\s+python train\.py (.*)$", page, re.M)
    assert len(examples) == 4
    for line in examples:
        # a sweep's first point, and the overrides without the flags
        overrides = [word.split(",")[0] for word in line.split() if not word.startswith("-") and "=" in word]
        cfg = make_cfg(*overrides)
        assert cfg.model is not None


def test_version_names_gptlabs_and_the_versions_a_bug_report_needs(tmp_path):
    from importlib import metadata

    import gptlab

    proc = train_py("--version", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == (
        f"gptlab {gptlab.__version__} (torch {metadata.version('torch')}, lightning {metadata.version('lightning')}, "
        f"hydra-core {metadata.version('hydra-core')}, Python {sys.version.split()[0]})\n"
    )
    assert not {"torch", "lightning", "wandb"} & imported(proc.stderr)  # an answer in a fraction of a second
    assert not any(tmp_path.iterdir())  # no run directory
    listed = train_py("--help", cwd=tmp_path).stdout
    assert "--version : Show gptlab's version" in listed and "Hydra's version" not in listed


def test_hydras_own_help_is_one_flag_away():
    proc = train_py("--hydra-help")
    assert proc.returncode == 0
    assert "hydra/launcher:" in proc.stdout and "== Flags ==" in proc.stdout


# ---- a mistyped choice -----------------------------------------------------------------------------------


def test_a_mistyped_choice_gets_the_closest_one_and_no_search_path(tmp_path):
    proc = train_py("pos=sinusiodal", cwd=tmp_path)
    err = without_import_times(proc.stderr)
    assert proc.returncode == 2, err
    assert err.startswith("gptlab: error: Could not find 'pos/sinusiodal'"), err
    assert f"Choose pos from: {', '.join(choices('pos'))}." in err
    assert err.rstrip().endswith("Did you mean pos=sinusoidal?")
    assert "Config search path" not in err and "HYDRA_FULL_ERROR" not in err
    assert not {"torch", "lightning"} & imported(proc.stderr)
    assert list(tmp_path.iterdir()) == []  # no run folder


def test_a_mistyped_choice_in_a_sweep_is_refused_before_any_job_runs(tmp_path):
    proc = train_py("-m", "activation=gelu,swiglu,gleu", "hydra/launcher=basic", cwd=tmp_path)
    err = without_import_times(proc.stderr)
    assert proc.returncode == 2, err
    assert "Could not find 'activation/gleu'" in err and "Did you mean activation=gelu?" in err
    assert not {"torch", "lightning"} & imported(proc.stderr)  # no job started
    assert list(tmp_path.iterdir()) == []  # nor the sweep folder Hydra made for its multirun.yaml


def test_a_mistyped_key_is_refused_with_the_closest_one_before_any_heavy_import(tmp_path):
    proc = train_py("optim.lrr=1e-3", cwd=tmp_path)
    err = without_import_times(proc.stderr)
    assert proc.returncode == 2, err
    assert err.startswith("gptlab: error: optim has no key 'lrr' (optim.lrr=1e-3). Its keys: optim.name,"), (
        err
    )
    assert err.rstrip().endswith("Did you mean optim.lr=1e-3?"), err
    # not Hydra's advice to add the typo with +, which only leads to a second refusal
    assert "+optim.lrr" not in err and "not in struct" not in err and "HYDRA_FULL_ERROR" not in err
    assert not {"torch", "lightning"} & imported(proc.stderr)
    assert list(tmp_path.iterdir()) == []  # no run folder


def test_a_mistyped_key_in_a_sweep_is_refused_before_any_job_with_the_values_typed(tmp_path):
    proc = train_py("-m", "optim.lrr=1e-3,1e-2", "seed=0,1", "hydra/launcher=basic", cwd=tmp_path)
    err = without_import_times(proc.stderr)
    assert proc.returncode == 2, err
    # the sweep's values as typed, not the first job's (optim.lrr=0.001)
    assert "optim has no key 'lrr' (optim.lrr=1e-3,1e-2)" in err and "Did you mean optim.lr=1e-3,1e-2?" in err
    assert not {"torch", "lightning"} & imported(proc.stderr)  # no job started
    assert list(tmp_path.iterdir()) == []  # nor the sweep folder


def test_a_missing_primary_config_keeps_hydras_report_with_its_search_path(tmp_path):
    # no group to choose from: where Hydra looked for configs is what helps (e.g. a missing --config-dir)
    proc = train_py("--config-name", "nosuch", "--cfg", "job", cwd=tmp_path)
    assert proc.returncode == 1
    assert "Cannot find primary config 'nosuch'" in proc.stderr and "Config search path" in proc.stderr


# ---- a refusal before the heavy imports -----------------------------------------------------------------


def test_a_bad_value_is_refused_before_lightning_is_imported_and_leaves_no_run_folder(tmp_path):
    proc = train_py("model.n_layer=-1", cwd=tmp_path)  # the default run dir: outputs/runs/<date>/<time>
    err = without_import_times(proc.stderr)
    assert proc.returncode == 2, err
    assert "gptlab: error: model.n_layer=-1 must be a positive integer (e.g. model.n_layer=4)." in err
    assert not {"lightning", "lightning_fabric", "pytorch_lightning", "wandb", "datasets"} & imported(
        proc.stderr
    )
    assert list(tmp_path.iterdir()) == []  # no run folder, nor the outputs/runs/<date> folders made for it


def test_the_trainer_arguments_read_from_lightnings_source_are_its_signatures():
    import inspect

    import lightning as L

    from gptlab.preflight import trainer_arguments

    assert set(trainer_arguments()) == set(inspect.signature(L.Trainer.__init__).parameters) - {"self"}


# ---- no run folder left by a refusal ----------------------------------------------------------------------


# A refused run in the default run dir: test_a_bad_value_is_refused_before_lightning_is_imported_and_...


def test_a_refusal_keeps_a_run_folder_that_was_there_before(tmp_path):
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    proc = train_py("model.n_layer=-1", f"hydra.run.dir={earlier}", cwd=tmp_path)
    assert proc.returncode == 2
    assert earlier.is_dir() and (earlier / ".hydra").is_dir()


def test_a_refused_sweep_leaves_no_job_folders(tmp_path):
    sweep = tmp_path / "sweep"
    proc = train_py("-m", "model.n_layer=-1,-2", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert "job #0 (n_layer=-1) was refused: model.n_layer=-1 must be a positive integer" in proc.stderr
    assert "job #1 (n_layer=-2) was refused: model.n_layer=-2 must be a positive integer" in proc.stderr
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[
        -3000:
    ]  # as a single refused run
    assert "Error executing job" not in proc.stderr  # Hydra's line, which would only repeat gptlab's
    assert [p.name for p in sweep.iterdir()] == ["multirun.yaml"]


@pytest.mark.slow
def test_a_refused_sweep_under_joblib_leaves_no_job_folders_and_names_the_job(tmp_path):
    """joblib runs each job in a worker process that shares none of the command's state: the folders the
    command made reach it through the environment, and the job's number travels with its pickled error."""
    sweep = tmp_path / "sweep"
    proc = train_py(
        "-m", "hydra/launcher=joblib", "model.n_layer=-1,-2", f"hydra.sweep.dir={sweep}", cwd=tmp_path
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "Error executing job" not in proc.stderr  # Hydra's line, which would only repeat gptlab's
    assert "job #1 (n_layer=-2) was refused: model.n_layer=-2 must be a positive integer" in proc.stderr
    assert "job #0 (n_layer=-1) was refused: model.n_layer=-1 must be a positive integer" in proc.stderr
    # the sweep's last line names the first failed job; its message was printed once, by the worker that ran
    # it on this same stderr
    assert (
        "gptlab: error: the first job of the sweep that did not run to the end: job #0 (n_layer=-1) was refused "
        "(its message is above)"
    ) in proc.stderr
    for message in (
        "model.n_layer=-1 must be a positive integer",
        "model.n_layer=-2 must be a positive integer",
    ):
        assert proc.stderr.count(message) == 1, proc.stderr[-3000:]
    assert [p.name for p in sweep.iterdir()] == ["multirun.yaml"]
    # conf/hydra/launcher/joblib.yaml is the config loaded, without Hydra's warning (from the command and from
    # each worker) that it matched the plugin's same-named schema
    assert "validated against ConfigStore schema" not in proc.stderr, proc.stderr[-3000:]


def test_only_what_the_refused_run_wrote_in_folders_it_made_is_removed(tmp_path):
    from gptlab.cli import NoteNewDirectories, remove_refused_run_dir

    def refused_run(run_dir, *files):
        NoteNewDirectories()._note(run_dir)  # as Hydra calls it, before the folder is made
        (run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
        (run_dir / ".hydra" / "config.yaml").write_text("model: {}\n")
        for name in ("train.log", *files):
            (run_dir / name).write_text("x")
        return remove_refused_run_dir(run_dir, "train.log")

    # refused after run.json was written (a data error): the folder and the parents it made go
    beside = tmp_path / "runs" / "other"
    beside.mkdir(parents=True)
    assert refused_run(tmp_path / "runs" / "day" / "a", "run.json")
    assert not (tmp_path / "runs" / "day").exists() and beside.is_dir()
    # anything else in it (a log file of Lightning's, a checkpoint) keeps the folder
    assert not refused_run(tmp_path / "b", "run.json", "metrics.csv")
    assert (tmp_path / "b" / "metrics.csv").is_file()
    # a folder that existed before the command, also empty, stays
    (tmp_path / "c").mkdir()
    assert not refused_run(tmp_path / "c")
    assert (tmp_path / "c" / "train.log").is_file()


# ---- the exit --------------------------------------------------------------------------------------------


def test_the_objects_left_at_exit_are_frozen_once_as_the_exit_begins_not_before():
    """train.py's process hands its objects to no garbage collection at exit (seconds over torch's, Lightning's
    and W&B's objects): they are frozen when the exit handlers run, after the run and its own handlers (W&B's,
    registered later, run first), and a process that runs train.py several times registers it once."""
    code = (
        "import atexit, gc\n"
        "atexit.register(lambda: print('frozen when the last handler runs:', gc.get_freeze_count() > 0))\n"
        "from gptlab.tasks.collector import exit_without_collecting\n"
        "exit_without_collecting(); exit_without_collecting()\n"
        "atexit.register(lambda: print('frozen when a later handler runs:', gc.get_freeze_count() > 0))\n"
        "print('frozen while it runs:', gc.get_freeze_count() > 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "frozen while it runs: False",
        "frozen when a later handler runs: False",
        "frozen when the last handler runs: True",
    ]
    source = (ROOT / "train.py").read_text()
    assert "exit_without_collecting()" in source.split('if __name__ == "__main__":', 1)[1]


def test_the_first_failed_jobs_message_is_repeated_at_the_end_only_where_its_worker_printed_it_elsewhere(
    tmp_path, capfd
):
    """A launcher's worker that shares the command's stderr (joblib's) said the job's message there: the
    sweep's last line names the job only. One whose stderr is another file (a SLURM job's log) said it where
    the user may not look: the last line gives the message."""
    from gptlab import cli
    from gptlab.errors import ConfigError

    def last_line(printed_to):
        error = ConfigError("model.n_layer=-1 must be a positive integer (e.g. model.n_layer=4).")
        setattr(error, cli.FAILED_JOB_ATTR, (0, "n_layer=-1", True, None, printed_to))
        cli._sweep = (tmp_path, None)
        with pytest.raises(SystemExit) as stop:
            cli.end_failed_sweep(error)
        assert stop.value.code == 2
        return capfd.readouterr().err.strip().splitlines()[-1]

    here = cli._stderr_identity()
    assert here is not None
    assert last_line(here) == (
        "gptlab: error: the first job of the sweep that did not run to the end: job #0 (n_layer=-1) was refused "
        "(its message is above)"
    )
    elsewhere = (here[0], here[1] + 1)
    assert last_line(elsewhere) == (
        "gptlab: error: the first job of the sweep that did not run to the end: job #0 (n_layer=-1) was refused: "
        "model.n_layer=-1 must be a positive integer (e.g. model.n_layer=4)."
    )
