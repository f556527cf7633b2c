"""One run per run directory.

A run directory holds exactly one run: the first start and every resumed part of it. ``run.json`` says which
run it is (an id drawn when the run starts), when each part started and from which step, and on which host and
process it runs, so that a reader can tell a finished run from a killed one and from one still running.

A fresh start into a directory that already holds a run is refused before anything is written (before Hydra
rewrites ``.hydra/``, before any logger opens a file), with the two ways on: ``resume=auto`` to continue it, or
another ``hydra.run.dir``. ``overwrite=true`` starts anew there and moves the old run's files aside, whole,
into ``<run dir>/.replaced/<time>/``: nothing is merged, nothing is lost. Nothing here imports torch.

While a run runs, its process holds the directory's claim (``run.lock``: pid, host, start time, run id), taken
before the run writes anything: a second process started into the same directory at the same time (two
commands with one ``hydra.run.dir``, two ``resume=auto`` of one run) is refused by name instead of writing
beside it. The claim is a file created whole by one exclusive link (it exists or it does not: two processes
cannot both create it), held with an advisory lock that the kernel drops when its process ends, however it
ends; a claim whose process is gone is taken over. Only rank 0 claims: the ranks a launcher started for the
same run join it. A default run directory (named by the second) is chosen the same way: the next name that
this process creates itself (``-1``, ``-2``... when another run took the second).
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import logging
import os
import shlex
import socket
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gptlab.errors import ConfigError
from gptlab.runs.jsonfile import dumps
from gptlab.runs.layout import (
    CHECKPOINT_DIR,
    CLAIM_FILE,
    CONFIG_FILE,
    EVAL_LENGTH_DIR,
    HPC_GLOB,
    HYDRA_DIR,
    REPLACED_DIR,
    RESULT_FILE,
    RUN_FILE,
    Run,
    RunInfo,
    find_run_dirs,
    read_run_info,
    run_of_path,
)

log = logging.getLogger(__name__)

# What shows that a run started training in a directory: config_resolved.yaml is written just before the
# first step, checkpoints and the length study after it. run.json and Hydra's .hydra/ are written earlier,
# also by a command then refused at config time.
_TRAINED_OUTPUTS = (CONFIG_FILE, CHECKPOINT_DIR, EVAL_LENGTH_DIR)
# What a start can leave before training (a logger that failed to open, a crash building the trainer): with
# none of the above, these are a failed start's, moved aside by the next start, not a run that blocks it.
_START_OUTPUTS = (RESULT_FILE, "csv", "wandb", "tensorboard")
# Environment variables that mark a process started by a launcher for rank > 0 (Lightning, torchrun, srun).
_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID")


class RunDirectoryInUse(ConfigError):
    """A fresh run was asked to start in a directory that already holds another run."""


def launched_rank() -> bool:
    """True in a process that a launcher started for a rank other than 0: rank 0 checks and claims the run
    directory for all of them."""
    return any(os.environ.get(name, "0") not in ("", "0") for name in _RANK_VARIABLES)


def _present(run_dir: Path, names: tuple[str, ...]) -> list[Path]:
    found = []
    for name in names:
        path = run_dir / name
        if path.is_file() or (path.is_dir() and any(path.iterdir())):
            found.append(path)
    return found


def _result_says_trained(run_dir: Path) -> bool:
    """True when ``result.json`` reports a run that trained: a step taken, or finished."""
    try:
        result = json.loads((run_dir / RESULT_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(result, dict) and (
        bool(result.get("finished")) or int(result.get("global_step") or 0) > 0
    )


def previous_run_files(run_dir: Path) -> list[Path]:
    """The files and folders in ``run_dir`` that show an earlier run started training there (``run.json``,
    Hydra's ``.hydra/`` and log alone do not: a command refused at config time leaves them; nor do the files
    of a start that failed before training, :func:`failed_start_files`)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    trained = _present(run_dir, _TRAINED_OUTPUTS) + sorted(run_dir.glob(HPC_GLOB))
    if not trained and not _result_says_trained(run_dir):
        return []
    return _present(run_dir, (RESULT_FILE,)) + trained + _present(run_dir, _START_OUTPUTS[1:])


def failed_start_files(run_dir: Path) -> list[Path]:
    """What a start that failed before training left in ``run_dir`` (a logger's folder, a ``result.json``
    of step 0), when no run trained there; empty otherwise."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir() or previous_run_files(run_dir):
        return []
    return _present(run_dir, _START_OUTPUTS)


def resume_asked(resume: Any) -> bool:
    return resume not in (None, False, "", "null", "none", "None", "false", "False")


def continues_a_run(resume: Any, run_dir: Path) -> bool:
    """True when ``resume`` continues the run in ``run_dir``: ``auto`` with a checkpoint there to continue
    from (one a kill set aside mid-swap counts: it is put back before loading), or a path inside it; or,
    without ``resume``, a requeued SLURM job finding its preemption checkpoint."""
    run_dir = Path(run_dir)
    if not resume_asked(resume):
        # A SLURM job requeued after preemption runs the same command again, in the same directory, and
        # Lightning continues from the preemption checkpoint it left there.
        return bool(os.environ.get("SLURM_JOB_ID")) and bool(Run(run_dir).preemption_checkpoints())
    if resume == "auto":
        run = Run(run_dir)
        return run.resume_checkpoint() is not None or bool(run.set_aside_checkpoints())
    resumed = run_of_path(Path(str(resume)).expanduser())
    return resumed is not None and resumed.path.resolve() == run_dir.resolve()


def move_aside(run_dir: Path, paths: list[Path]) -> Path:
    """Move ``paths`` (inside ``run_dir``) into ``<run_dir>/.replaced/<time>/``, keeping their names."""
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    target = run_dir / REPLACED_DIR / stamp
    n = 1
    while target.exists():
        n += 1
        target = run_dir / REPLACED_DIR / f"{stamp}_{n}"
    target.mkdir(parents=True)
    for path in paths:
        os.replace(path, target / path.name)
    return target


def refusal(run_dir: Path, found: list[Path], key: str = "hydra.run.dir") -> str:
    names = ", ".join(p.name for p in found[:6]) + (", ..." if len(found) > 6 else "")
    return (
        f"{run_dir} already holds a run ({names}); a new run there would mix its metrics, checkpoints and W&B "
        f"files with that run's. Continue that run with resume=auto (the same overrides) or "
        f"resume={run_dir}; start a new run elsewhere with {key}=<another dir> (or leave {key} unset); or "
        "add overwrite=true to start anew there, with the old run's files moved to "
        f"{run_dir / REPLACED_DIR}/<time>/."
    )


def claim_run_dir(
    run_dir: Path, resume: Any, overwrite: bool, include_hydra: bool = False, log: Any = None
) -> Path | None:
    """Make sure a starting run that does not continue the run in ``run_dir`` (:func:`continues_a_run`,
    decided once by :func:`gptlab.runs.resume.enter_run`) is the only run there: nothing to do where no run
    started training; otherwise a
    :class:`RunDirectoryInUse`, or, with ``overwrite`` (or ``resume=auto`` finding nothing to continue), the
    old files moved aside (with ``include_hydra``, before Hydra writes, its ``.hydra/`` and log too).
    Returns the folder they were moved to, if any."""
    run_dir = Path(run_dir)
    if launched_rank():
        return None
    found = previous_run_files(run_dir)
    if not found:
        return _move_failed_start_aside(run_dir, include_hydra, log)
    if not overwrite and resume != "auto":
        raise RunDirectoryInUse(refusal(run_dir, found))
    found += [p for p in (run_dir / RUN_FILE,) if p.exists()]
    if include_hydra:  # before Hydra's job starts: the old run's .hydra/ and log go with it
        found += [p for p in (run_dir / HYDRA_DIR, *run_dir.glob("*.log")) if p.exists()]
    aside = move_aside(run_dir, found)
    if log is not None:
        why = "overwrite=true" if overwrite else "resume=auto found no checkpoint to continue from"
        log.warning("%s: the earlier run's files in %s are moved to %s", why, run_dir, aside)
    return aside


def _move_failed_start_aside(run_dir: Path, include_hydra: bool, log: Any) -> Path | None:
    """A start that failed before training (the same command, retried) leaves the directory free: its
    files are moved aside, whole, so that this run's loggers do not write beside them."""
    found = failed_start_files(run_dir)
    if not found:
        return None
    found += [p for p in (run_dir / RUN_FILE,) if p.exists()]
    if include_hydra:
        found += [p for p in (run_dir / HYDRA_DIR, *run_dir.glob("*.log")) if p.exists()]
    aside = move_aside(run_dir, found)
    if log is not None:
        log.warning(
            "%s holds the files of a start that failed before training (%s); moved to %s",
            run_dir,
            ", ".join(p.name for p in found),
            aside,
        )
    return aside


def claim_sweep_dir(sweep_dir: Path, resume: Any, overwrite: bool) -> Path | None:
    """The same for a multirun's ``hydra.sweep.dir``: refused when it holds runs, unless ``resume`` (each
    job continues its own directory) or ``overwrite`` (the old jobs and ``multirun.yaml`` moved aside)."""
    sweep_dir = Path(sweep_dir)
    if launched_rank() or resume_asked(resume):
        return None
    jobs = find_run_dirs(sweep_dir)
    if not jobs:
        return None
    if not overwrite:
        raise RunDirectoryInUse(
            f"{sweep_dir} already holds {len(jobs)} run(s) of an earlier sweep ({', '.join(p.name for p in jobs[:4])}"
            f"{', ...' if len(jobs) > 4 else ''}); new jobs there would mix with them. Continue that sweep with "
            "resume=auto (the same command: each job continues its own directory); start a new sweep with "
            "hydra.sweep.dir=<another dir> (or leave it unset); or add overwrite=true to move the old jobs to "
            f"{sweep_dir / REPLACED_DIR}/<time>/."
        )
    top = {sweep_dir / job.relative_to(sweep_dir).parts[0] for job in jobs} | {sweep_dir / "multirun.yaml"}
    return move_aside(sweep_dir, sorted(p for p in top if p.exists()))


# ---- run.json ------------------------------------------------------------------------------------------------


def record_start(run_dir: Path, continued: bool, overrides: list[str], task: str) -> RunInfo:
    """Write ``run.json`` for a new run, or add a part to it for a run that ``continued``."""
    run_dir = Path(run_dir)
    info = read_run_info(run_dir) if continued else None
    part = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "started_unix": time.time(),
        "resumed": bool(continued),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "overrides": list(overrides),
    }
    # a new run takes the id its claim announced (run.lock names the run while it runs)
    claim = held_claim(run_dir)
    new_id = claim.run_id if claim is not None else uuid.uuid4().hex[:12]
    info = RunInfo(info.run_id if info else new_id, [*(info.parts if info else []), part])
    data = {"run_id": info.run_id, "task": task, "parts": info.parts}
    tmp = run_dir / f".{RUN_FILE}.tmp"
    tmp.write_text(dumps(data))
    os.replace(tmp, run_dir / RUN_FILE)
    return info


# ---- the claim: one running process per run directory ----------------------------------------------------


class RunDirectoryClaimed(RunDirectoryInUse):
    """A run was asked to start in a directory that another running process holds."""


@dataclass(frozen=True)
class Claim:
    """What ``run.lock`` says: which process runs in the directory, since when, and which run it is."""

    pid: int
    host: str
    started: str
    started_unix: float
    run_id: str
    command: str
    slurm_job_id: str | None = None

    @classmethod
    def read(cls, path: Path) -> Claim | None:
        """The claim in ``path``; None when there is none or it cannot be read."""
        try:
            data = json.loads(Path(path).read_text())
            return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})
        except (OSError, ValueError, TypeError):
            return None

    def describe(self) -> str:
        return f"process {self.pid} on {self.host} (run {self.run_id}, since {self.started}: {self.command})"


@dataclass
class _Held:
    fd: int
    claim: Claim


# The claims this process holds, by resolved run directory; the open file keeps each claim's lock.
_held: dict[Path, _Held] = {}


def _forget_claims_in_child() -> None:
    """A forked child (a data loader worker) is not the run: it closes its copies of the claims' files, so
    that the lock goes with the run's own process (the parent keeps it)."""
    for held in _held.values():
        try:
            os.close(held.fd)
        except OSError:
            pass
    _held.clear()


os.register_at_fork(after_in_child=_forget_claims_in_child)


def held_claim(run_dir: Path) -> Claim | None:
    """The claim this process holds on ``run_dir``, if any."""
    held = _held.get(Path(run_dir).absolute().resolve())
    return held.claim if held else None


def running_claim(run_dir: Path) -> Claim | None:
    """The claim of the process that runs in ``run_dir`` now (this process included), or None when none does:
    its ``run.lock`` is there and locked, or, on a filesystem without locks, names a process alive on this
    host. A run that ended, however, holds no lock: its process gave the claim up, or is gone."""
    path = Path(run_dir) / CLAIM_FILE
    own = held_claim(run_dir)
    if own is not None:  # this process (another thread, or the caller's own run)
        return own
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        claim = Claim.read(path)
        locked = _lock(fd)
        if locked is None:
            return None if _abandoned_without_locks(claim) else claim
        return claim if locked is False else None
    finally:
        os.close(fd)  # and with it the lock, where this look took it


def _lock(fd: int) -> bool | None:
    """Try to take the lock of a claim's file: True when taken, False when another process holds it, None
    where the filesystem has no such locks."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return None
        raise


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _abandoned_without_locks(claim: Claim | None) -> bool:
    """On a filesystem without locks: whether the claim's process is known to be gone (this host and its
    pid not running, or an earlier incarnation of this requeued SLURM job)."""
    if claim is None:
        return False
    if claim.host == socket.gethostname():
        return not _process_alive(claim.pid)
    job = os.environ.get("SLURM_JOB_ID")
    return bool(job) and claim.slurm_job_id == job


def _publish(path: Path, claim: Claim) -> int | None:
    """Create ``path`` holding ``claim``, locked, and only if it does not exist; the open, locked file's
    descriptor, or None when another claim is there. The claim is written and locked under a private name
    first and then linked into place (a link fails where the name exists): a reader never sees a claim
    half written or not yet locked."""
    private = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    fd = os.open(private, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, dumps(asdict(claim)).encode())
        _lock(fd)
        try:
            os.link(private, path)
        except FileExistsError:
            os.close(fd)
            return None
        except OSError as e:  # a filesystem without hard links: O_EXCL on the name itself
            if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK):
                raise
            os.close(fd)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return None
            os.write(fd, dumps(asdict(claim)).encode())
            _lock(fd)
        return fd
    finally:
        os.unlink(private)


def _same_file(fd: int, path: Path) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _take_over_if_abandoned(path: Path) -> Claim | None:
    """Remove the claim at ``path`` if its process is gone; returns the claim that stays (a live one), or
    None when the name is free again. An abandoned claim is removed while holding its lock, and only if
    ``path`` still names that file: of two processes taking it over at once, one removes it and creates its
    own, and the other then finds that new, live claim."""
    for _ in range(50):
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            claim = Claim.read(path)
            locked = _lock(fd)
            abandoned = locked if locked is not None else _abandoned_without_locks(claim)
            if abandoned and _same_file(fd, path):
                os.unlink(path)
                log.warning(
                    "%s: taking over the claim of a run whose process is gone (%s)",
                    path.parent,
                    claim.describe() if claim else "unreadable claim",
                )
                return None
            if not _same_file(fd, path):
                continue  # replaced meanwhile: look at the new claim
            if locked is False and claim is not None and claim.host == socket.gethostname():
                if not _process_alive(claim.pid):
                    # its process is gone but another process holds the lock: one taking it over right
                    # now (it holds the lock for a moment), or a child the run left behind
                    time.sleep(0.1)
                    continue
            return claim or Claim(0, "?", "?", 0.0, "?", "an unreadable claim")
        finally:
            os.close(fd)
    return Claim.read(path) or Claim(0, "?", "?", 0.0, "?", "an unreadable claim")


def claimed_message(run_dir: Path, other: Claim, key: str = "hydra.run.dir") -> str:
    path = Path(run_dir) / CLAIM_FILE
    gone = (
        f" If that process is gone (this filesystem has no locks to tell), delete {path}."
        if other.host != socket.gethostname()
        else ""
    )
    return (
        f"{run_dir} is in use: {other.describe()} is running there (it holds {path}). Two runs in one "
        "directory would mix their metrics, checkpoints and W&B files. Start this run elsewhere with "
        f"{key}=<another dir> (or leave {key} unset: a new directory of its own); or wait for that run to "
        f"end, then continue it with resume=auto (the same overrides).{gone}"
    )


def _new_claim(run_dir: Path, continued: bool) -> Claim:
    info = read_run_info(run_dir) if continued else None
    return Claim(
        pid=os.getpid(),
        host=socket.gethostname(),
        started=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        started_unix=time.time(),
        run_id=info.run_id if info else uuid.uuid4().hex[:12],
        command=_command_line(),
        slurm_job_id=os.environ.get("SLURM_JOB_ID") or None,
    )


def _command_line() -> str:
    """This process's command, as typed (``python train.py ...``)."""
    argv = [a for a in sys.argv if a] or ["python"]
    line = shlex.join([Path(argv[0]).name, *argv[1:]])
    return f"python {line}" if argv[0].endswith(".py") else line


def hold_run_dir(run_dir: Path, continued: bool = False, key: str = "hydra.run.dir") -> Claim | None:
    """Claim ``run_dir`` for this process (creating it), before the run writes anything there (a run that
    ``continued`` the one there announces that run's id); a
    :class:`RunDirectoryClaimed` naming the other process when a live one holds it. Holding it already is
    fine (Hydra's callback claims first, the task again). A claim whose process is gone is taken over.
    On ranks a launcher started: nothing (they join the run rank 0 claimed), None."""
    if launched_rank():
        return None
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    where = run_dir.absolute().resolve()
    if where in _held:
        return _held[where].claim
    claim = _new_claim(run_dir, continued)
    path = run_dir / CLAIM_FILE
    for _ in range(50):
        fd = _publish(path, claim)
        if fd is not None:
            _held[where] = _Held(fd, claim)
            return claim
        other = _take_over_if_abandoned(path)
        if other is not None:
            raise RunDirectoryClaimed(claimed_message(run_dir, other, key))
    raise RunDirectoryClaimed(f"{run_dir}: could not claim {path}; another process keeps replacing it.")


def release_run_dir(run_dir: Path) -> None:
    """Give up this process's claim on ``run_dir`` (the run ended): its ``run.lock`` removed."""
    held = _held.pop(Path(run_dir).absolute().resolve(), None)
    if held is None:
        return
    try:
        if _same_file(held.fd, Path(run_dir) / CLAIM_FILE):
            os.unlink(Path(run_dir) / CLAIM_FILE)
    except OSError:  # the directory went away: nothing to release
        pass
    finally:
        os.close(held.fd)


@atexit.register
def _release_all() -> None:
    for where in list(_held):
        release_run_dir(where)


#: The run directories (and the folders above them) that this process created in take_new_run_dir: a command
#: refused at config time removes what it made (gptlab.cli), and only that.
_made_here: set[Path] = set()


def made_by_this_process() -> set[Path]:
    """The folders :func:`take_new_run_dir` created in this process (absolute paths)."""
    return set(_made_here)


def take_new_run_dir(directory: str) -> str:
    """``directory``, or ``directory-1``, ``-2``...: the first of them that this process creates itself,
    claimed (a default run directory is named by the second, and two runs can start in one). One this
    process holds already is its own (Hydra resolves ``hydra.run.dir`` more than once per job)."""
    candidate, n = directory, 0
    while True:
        if held_claim(Path(candidate)) is not None:
            return candidate
        folder = Path(os.path.abspath(candidate))
        missing = [p for p in folder.parents if not p.exists()]
        folder.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(candidate)
        except FileExistsError:
            pass
        else:
            _made_here.update([folder, *missing])
            try:
                hold_run_dir(Path(candidate))
                return candidate
            except RunDirectoryClaimed:  # claimed by name (hydra.run.dir) the moment it was made
                pass
        n += 1
        candidate = f"{directory}-{n}"
