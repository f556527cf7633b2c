"""A rank that is lost: how the other processes of a run notice it, stop, and say so.

When one process of a distributed run dies (the kernel's out-of-memory killer, a segfault, a kill), the
others are left in or before a collective that cannot complete. What they see depends on the transport:
over gloo on one machine the dead process's sockets are reset and the survivors' next collective raises a
``Connection reset by peer`` that names no rank; NCCL learns nothing and waits until the process group's
timeout (Lightning passes 30 minutes); a rank that is alive but stuck, or a node that vanished, is waited
for until that timeout on any transport. Lightning's own observer of the ranks it starts SIGKILLs every
process up to five seconds after a child fails, with one line in the log file and none on the console,
before the run can record anything (``result.json`` is not written).

So, for the ranks Lightning starts on one node by re-running the command line (``ddp``, ``fsdp``,
``deepspeed_*``; :class:`WatchedLauncher` replaces Lightning's observer):

- rank 0 watches the processes it started (:func:`watch_children`, a daemon thread polling their exit
  status): when one ends with a non-zero status or a signal, the main thread, whose next or current
  collective fails, reports the lost rank by name (:func:`lost_during`: a :class:`~gptlab.errors.RankLostError`,
  recorded in ``result.json``). Where the main thread cannot fail (NCCL waits on), the watcher reports after
  :data:`REPORT_GRACE_S` and ends the process. Either way the ranks it started that are left are ended with it
  (:func:`end_children`).
- every other rank watches the process that started it (:func:`watch_launcher`: its parent pid): when
  rank 0 is gone (killed, crashed, or failed while this rank waited), this rank stops as well, instead of
  waiting in a collective as an orphan. A polling thread is used rather than ``prctl(PR_SET_PDEATHSIG)``:
  that signal would end the process without a word (a handler cannot run while the main thread waits in
  C++), it fires when the *thread* that started the child ends, and it exists on Linux only.

For the ranks torchrun or SLURM (``srun``) start, each a child of the launcher's own process on its node
(torchrun's agent, SLURM's step daemon):

- each rank watches the ranks started beside it (:func:`watch_ranks_beside`): the other children of its
  parent whose environment carries the same run (:class:`Launcher`: ``TORCHELASTIC_RUN_ID`` and ``RANK``;
  SLURM's job and step ids and ``SLURM_PROCID``), found in ``/proc``. When one is gone the run stops with
  the same report, naming it; how it ended only the launcher, its parent, can tell (torchrun's summary
  gives its exit code), so the message says where to read it. Where the lost rank is rank 0, the lowest rank
  left on its node records the failure in its place (``result.json``). A rank that ended normally is no lost
  rank: the others are then past their last collective, and their main thread stands the watch down within
  :data:`REPORT_GRACE_S`.
- torchrun's agent sends SIGTERM to the other ranks as soon as one fails, and SIGKILL 30 s later. During
  training the signal is the training's own to handle (a save at the step's end, decided by a collective
  that fails at once over gloo where a rank is gone: the step in progress is not saved, the report names the
  last checkpoint written whole); once a failure is being reported, the signal is held (:func:`_on_stop_signal`)
  so that the report and ``result.json`` are not cut short.
- the command that continues the run is the torchrun command typed, read from the agent's command line
  (:func:`continue_command`).
- a rank on another node is not watched: its loss is seen where a collective's connection to it breaks
  (:func:`peer_lost`: the message says a rank on another node is lost, and which ranks here are alive), or
  after the timeout below.

Either way, the process group's timeout is a strategy option (``strategy.timeout_s``): it bounds the wait for
a rank that is stuck rather than dead (named where it is on this node: :func:`stuck_ranks`), and for ranks
on other nodes where NCCL learns nothing of their loss.
"""

from __future__ import annotations

import atexit
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

log = logging.getLogger("gptlab")

#: Set by rank 0 for the processes it starts: its pid, so that each knows which parent to watch.
LAUNCHER_PID_ENV = "GPTLAB_LAUNCHER_PID"
POLL_S = 0.5
#: How long rank 0's watcher leaves the main thread to report a lost rank itself (its collective fails at once
#: over gloo; a step, or a checkpoint being written, finishes first) before it reports and ends the process.
REPORT_GRACE_S = 15.0
#: The same for a rank whose launching process is gone: it has nothing to finish (rank 0 writes the run's
#: files), only its own error to print first where its collective fails.
ORPHAN_GRACE_S = 5.0
#: How long the main thread, whose collective failed, waits for its watcher to see which rank is gone.
NOTICE_WAIT_S = 5.0


@dataclass(frozen=True)
class Launcher:
    """A launcher that starts the ranks of a node itself, each a child of one process of its own (torchrun's
    agent, SLURM's step daemon): how its ranks are recognised in their environment."""

    name: str  # as the user knows it
    run_variables: tuple[str, ...]  # whose values every rank of one run shares
    rank_variable: str  # the global rank


TORCHRUN = Launcher(
    "torchrun", ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "MASTER_ADDR", "MASTER_PORT"), "RANK"
)
SLURM = Launcher("SLURM", ("SLURM_JOB_ID", "SLURM_STEP_ID"), "SLURM_PROCID")
#: Where each launcher says how a rank it started ended.
REPORTS = {
    "torchrun": "how, torchrun's summary says: its exitcode, printed as torchrun stops",
    "SLURM": "how, srun's error line for its task says",
}


def external_launcher() -> Launcher | None:
    """The launcher that started this process as one rank of many beside others (torchrun first: it may run
    under srun), or None."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return TORCHRUN
    if os.environ.get("SLURM_STEP_ID") and os.environ.get("SLURM_PROCID"):
        return SLURM
    return None


@dataclass(frozen=True)
class LostRank:
    """A process of the run that is gone: its global rank, pid, and how it ended (``returncode`` as
    ``subprocess`` gives it: negative for a signal; None where this process cannot know, a parent)."""

    rank: int
    world_size: int
    pid: int
    returncode: int | None
    parent: bool = False  # the process that started this one (rank 0 seen from a rank it started)
    launcher: str | None = None  # "torchrun", "SLURM": a rank that launcher started beside this one

    def how(self) -> str:
        """How it ended, in words: ``was killed by SIGKILL (signal 9)``, ``exited with status 3``."""
        code = self.returncode
        if code is None and self.launcher is not None:
            return f"ended ({REPORTS[self.launcher]})"
        if code is None:
            return "ended (how, only its parent could tell)"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"was killed by {name} (signal {-code})"
        return f"exited with status {code}"

    def hint(self) -> str:
        """What the way it ended usually means."""
        oom = (
            "the kernel's out-of-memory killer sends: `dmesg | grep -i -e oom -e killed` says whether it did "
            "(then lower data.batch_size, or use activation_checkpointing=true)."
        )
        if self.returncode is None and self.launcher is not None:
            return f" SIGKILL (exit code -9, or 137) is what {oom} Any error of its own is printed above."
        if self.returncode == -signal.SIGKILL:
            return f" SIGKILL is what {oom}"
        if self.returncode == -signal.SIGSEGV:
            return " A segmentation fault: its own output above shows where."
        if self.returncode is not None and self.returncode > 0:
            return " Its own error is printed above, before this message."
        return ""

    def summary(self) -> str:
        """``Rank 1 of 2 (pid 4242) was killed by SIGKILL (signal 9)``."""
        started = ", which started this process," if self.parent else ""
        if self.launcher is not None:
            started = f", started beside this one by {self.launcher},"
        return f"Rank {self.rank} of {self.world_size} (pid {self.pid}){started} {self.how()}"


class _State:
    """This process's watch: the lost rank once seen, and who reports it: the main thread or the watcher,
    whichever takes ``reporting`` first (the other stands down)."""

    def __init__(self) -> None:
        # Set by the task: the message for a lost rank (step, checkpoint, command), how to record it, and how
        # this process takes over rank 0's records (a rank started beside a lost rank 0).
        self.describe: Callable[[LostRank], str] | None = None
        self.record: Callable[[Exception], None] | None = None
        self.stand_in: Callable[[], None] | None = None
        self.watch(None)

    def watch(self, watcher: RankWatcher | None) -> None:
        """A new watch (a process that trains twice watches anew)."""
        self.watcher = watcher
        self.children: list[tuple[int, subprocess.Popen]] = []  # (rank, process) of those this one started
        self.local: list[tuple[int, int]] = []  # (rank, pid) of the other ranks watched on this node
        self.rank: int | None = None  # this process's global rank, where it watches ranks started beside it
        self.launcher: Launcher | None = None  # the launcher that started them
        self.failing = False  # training raised: its failure is being reported
        self.lost: LostRank | None = None
        self.seen = threading.Event()
        self.reporting = threading.Lock()
        self.reporter: str | None = None  # "main" or "watcher", once one took the report

    def take_report(self, who: str) -> bool:
        """Whether ``who`` reports (it took the report now, or had it already)."""
        if self.reporting.acquire(blocking=False):
            self.reporter = who
        return self.reporter == who


_state = _State()


def set_reporter(
    describe: Callable[[LostRank], str],
    record: Callable[[Exception], None],
    stand_in: Callable[[], None] | None = None,
) -> None:
    """What the task says about a lost rank (``describe``) and how it records the failure (``record``:
    ``result.json``), for the watcher to use where the main thread cannot; ``stand_in``: how this process
    takes over rank 0's records (called where rank 0, started beside it by torchrun or SLURM, is the lost
    rank and this one is the lowest rank left on its node)."""
    _state.describe, _state.record, _state.stand_in = describe, record, stand_in


def clear_reporter() -> None:
    """Forget the task's reporter (:func:`set_reporter`) once its run is over: its closures hold the run's
    trainer, model, optimizer and data, which would otherwise keep their memory (a GPU's too) until the next
    run of the process sets another (``gptlab.train()`` calls this when it returns)."""
    _state.describe = _state.record = _state.stand_in = None


def _stand_in_for(lost: LostRank) -> None:
    """Where ``lost`` is rank 0, started beside this process, and no lower rank of the node is alive: this
    process records the run's failure in its place (``result.json``: rank 0 can no longer)."""
    if lost.launcher is None or lost.rank != 0 or _state.stand_in is None or _state.rank is None:
        return
    alive_below = [r for r, pid in _state.local if r < _state.rank and r != lost.rank and _alive(pid)]
    if not alive_below:
        _state.stand_in()


def describe(lost: LostRank) -> str:
    if _state.describe is not None:
        return _state.describe(lost)
    return f"{lost.summary()}; the run cannot go on without it.{lost.hint()}"


def lost_during(error: BaseException) -> LostRank | None:
    """Called by the main thread when training raised ``error``: the lost rank that explains it (waiting up
    to :data:`NOTICE_WAIT_S` for the watcher to see the process gone), or None when no rank is lost (the
    error is the run's own) or this process watches none. From here on the main thread reports: the watcher
    stands down (or, if it already took over, this thread waits for it to end the process)."""
    from gptlab.errors import ConfigError, DataError, DiskFullError, NonFiniteLossError

    if _state.watcher is None:
        return None
    _state.failing = True
    # gptlab's own errors explain themselves (a NaN loss stops every rank, each with its message: a rank that
    # ended first is no lost rank)
    own = isinstance(error, (ConfigError, DataError, DiskFullError, NonFiniteLossError))
    if not own:
        _state.seen.wait(NOTICE_WAIT_S)
    _main_reports()
    if own or _state.lost is None:
        return None
    _stand_in_for(_state.lost)
    return _state.lost


def training_over() -> None:
    """The main thread is past training (it ended, or its error is being reported): a process that ends
    from here on is no lost rank for this process's watcher to report."""
    if _state.watcher is not None:
        _main_reports()
        if not _state.failing:
            _end_stop_signal_shield()


def _main_reports() -> None:
    while not _state.take_report("main"):
        time.sleep(60)  # the watcher took the report: it ends the process


class RankWatcher(threading.Thread):
    """A daemon thread that polls ``check`` (the lost rank, or None) every ``poll_s``; once a rank is lost it
    leaves the main thread ``grace_s`` to report it, else it reports it itself (:func:`describe`, the task's
    ``record``, the message on stderr), calls ``before_exit`` and ends the process with status 1 (``atexit``
    handlers do not run then)."""

    def __init__(
        self,
        check: Callable[[], LostRank | None],
        before_exit: Callable[[], None] = lambda: None,
        poll_s: float = POLL_S,
        grace_s: float = REPORT_GRACE_S,
    ) -> None:
        super().__init__(daemon=True, name="gptlab-rank-watcher")
        self.check, self.before_exit, self.poll_s, self.grace_s = check, before_exit, poll_s, grace_s

    def run(self) -> None:
        lost = None
        while lost is None:
            time.sleep(self.poll_s)
            if _state.reporter == "main":
                return
            lost = self.check()
        _state.lost = lost
        _state.seen.set()
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline and _state.reporter is None:
            time.sleep(self.poll_s)
        if not _state.take_report("watcher"):
            return
        from gptlab.errors import RankLostError

        _stand_in_for(lost)
        error = RankLostError(describe(lost))
        if _state.record is not None:
            try:
                _state.record(error)
            except Exception as e:  # the report below must still come out
                log.warning("The failure could not be recorded: %r", e)
        print(f"\ngptlab: training failed: {error}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        self.before_exit()
        os._exit(1)


def start(watcher: RankWatcher) -> RankWatcher:
    _state.watch(watcher)
    watcher.start()
    return watcher


def watch_children(
    procs: list[subprocess.Popen], first_rank: int, world_size: int, **kwargs: Any
) -> RankWatcher:
    """Rank ``first_rank - 1``'s watch over the processes it started (``procs[i]`` is rank ``first_rank +
    i``): the first to end with a non-zero status or a signal is the lost rank. The others are ended when this
    process ends (:func:`end_children`): over gloo they fail by themselves with their own message, and where they
    would wait on (NCCL) they see this process gone."""

    def check() -> LostRank | None:
        for i, proc in enumerate(procs):
            code = proc.poll()
            if code:
                return LostRank(first_rank + i, world_size, proc.pid, code)
        return None

    atexit.register(end_children, procs)
    watcher = start(RankWatcher(check, lambda: end_children(procs, wait_s=0.0), **kwargs))
    _state.children = [(first_rank + i, proc) for i, proc in enumerate(procs)]
    return watcher


def end_children(procs: list[subprocess.Popen], wait_s: float = ORPHAN_GRACE_S + 5.0) -> None:
    """When rank 0 exits: the ranks it started that are still there after ``wait_s`` (they end by themselves
    when training ends, or, once rank 0 is gone, by their watch) are killed: one that is stuck, or stopped,
    would otherwise hold its memory and devices for ever. Where rank 0's watcher ends it (it waited its grace
    already), at once."""
    deadline = time.monotonic() + wait_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("Rank process %d is still there after rank 0 ended: killed", proc.pid)
            proc.kill()
            proc.wait()


def watch_launcher(launcher_pid: int, launcher_rank: int, world_size: int, **kwargs: Any) -> RankWatcher:
    """A started rank's watch over the process that started it (``launcher_pid``, rank ``launcher_rank``):
    once this process has another parent, that one is gone."""

    def check() -> LostRank | None:
        if os.getppid() == launcher_pid:
            return None
        return LostRank(launcher_rank, world_size, launcher_pid, None, parent=True)

    kwargs.setdefault("grace_s", ORPHAN_GRACE_S)
    return start(RankWatcher(check, **kwargs))


@dataclass(frozen=True)
class _ProcStat:
    state: str  # R, S, D, T, Z...
    parent: int
    started: int  # clock ticks after boot: with the pid, names one process (a pid is reused)


def _proc_stat(pid: int) -> _ProcStat | None:
    """``/proc/<pid>/stat``'s state, parent and start time; None once the process is gone (or no /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return _ProcStat(fields[0], int(fields[1]), int(fields[19]))
    except (OSError, IndexError, ValueError):
        return None


def _alive(pid: int) -> bool:
    stat = _proc_stat(pid)
    return stat is not None and stat.state not in "ZX"


def _environment(pid: int) -> dict[str, str]:
    """The environment ``pid`` was started with (empty where it cannot be read)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {key: value for key, _, value in pairs}


def ranks_beside(launcher: Launcher) -> dict[int, tuple[int, int]]:
    """The other ranks of this run that ``launcher`` started on this node: the processes with this one's
    parent whose environment carries this run's values of ``launcher.run_variables``; ``{rank: (pid, start
    time)}``."""
    parent, own = os.getppid(), os.getpid()
    run = [os.environ.get(name) for name in launcher.run_variables]
    found: dict[int, tuple[int, int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:  # not Linux: nothing is watched, the timeout bounds the wait
        return found
    for entry in entries:
        if not entry.isdigit() or int(entry) == own:
            continue
        stat = _proc_stat(int(entry))
        if stat is None or stat.parent != parent:
            continue
        env = _environment(int(entry))
        rank = env.get(launcher.rank_variable, "")
        if rank.isdigit() and [env.get(name) for name in launcher.run_variables] == run:
            found[int(rank)] = (int(entry), stat.started)
    return found


def watch_ranks_beside(
    launcher: Launcher, rank: int, world_size: int, ranks_on_node: int, **kwargs: Any
) -> RankWatcher:
    """The watch of a rank that ``launcher`` (torchrun, SLURM) started beside the other ranks of its node:
    the first of those others to end is the lost rank. How it ended only the launcher, its parent, knows:
    the message says where it reports it. Looked for again at each poll until all ``ranks_on_node - 1``
    are known (they start at about the same time).

    Also holds SIGTERM while this process reports a failure (:func:`_hold_stop_signal`): the launcher ends
    the others with SIGTERM as soon as one rank fails, and the report (``result.json``, the message) must
    not be cut short by it."""
    known: dict[int, tuple[int, int]] = {}

    def find() -> None:
        if len(known) < ranks_on_node - 1:
            for other, seen in ranks_beside(launcher).items():
                known.setdefault(other, seen)
            _state.local = sorted((other, pid) for other, (pid, _) in known.items())

    def check() -> LostRank | None:
        find()
        for other, (pid, started) in sorted(known.items()):
            stat = _proc_stat(pid)
            if stat is None or stat.state in "ZX" or stat.started != started:
                return LostRank(other, world_size, pid, None, launcher=launcher.name)
        return None

    watcher = start(RankWatcher(check, **kwargs))
    _state.rank, _state.launcher = rank, launcher
    find()
    _hold_stop_signal()
    return watcher


def _on_stop_signal(signum: int, frame: Any) -> None:
    """SIGTERM to a rank of torchrun or SLURM. During training the training's own handler runs first and
    calls this one after it (it stops training at the step's end): nothing more to do. Outside it, the
    signal ends the process as it would have without this handler, unless a failure is being reported:
    then the report ends it (the launcher ends it with SIGKILL if it does not, after its own grace: 30 s
    for torchrun)."""
    if signal.getsignal(signum) is not _on_stop_signal or _state.failing:
        return
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


_held_signal: list[Any] = []  # the SIGTERM handler found before this module's


def _hold_stop_signal() -> None:
    if threading.current_thread() is not threading.main_thread() or _held_signal:
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous in (signal.SIG_DFL, None):  # another handler (a cluster's plugin) is left to do its own
        _held_signal.append(previous)
        signal.signal(signal.SIGTERM, _on_stop_signal)


def _end_stop_signal_shield() -> None:
    if _held_signal and threading.current_thread() is threading.main_thread():
        if signal.getsignal(signal.SIGTERM) is _on_stop_signal:
            signal.signal(signal.SIGTERM, _held_signal[0] or signal.SIG_DFL)
        _held_signal.clear()


def peer_lost(error: BaseException) -> bool:
    """Whether ``error``, or one in its chain, is a collective whose connection to another rank broke (gloo:
    ``Connection reset by peer``, ``Connection closed by peer``): a rank this process does not watch, on
    another node, is gone."""
    seen: BaseException | None = error
    while seen is not None:
        text = str(seen).lower()
        if isinstance(seen, RuntimeError) and ("by peer" in text or "broken pipe" in text):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def ranks_alive_here() -> list[int]:
    """The ranks on this node known alive: this process's and those watched beside it."""
    alive = [rank for rank, pid in _state.local if _alive(pid)]
    return sorted({*alive, *([_state.rank] if _state.rank is not None else [])})


def who_ends_the_others() -> str:
    """Who ends the run's other processes once this one stops with an error: words for the message."""
    if _state.launcher is TORCHRUN:
        return "torchrun ends the other ranks it started"
    if _state.launcher is SLURM:
        return "srun ends the other tasks as the cluster is set to (its KillOnBadExit and WaitTime)"
    return "the ranks it started were ended"


def spawned_rank_lost(error: BaseException, world_size: int) -> LostRank | None:
    """The rank that ``error`` says ended, where it is ``torch.multiprocessing``'s report of a spawned rank
    (``ddp_spawn``: its join ends the other ranks itself); None for any other error."""
    from torch.multiprocessing import ProcessExitedException

    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, ProcessExitedException):
            return LostRank(seen.error_index, world_size, seen.error_pid, seen.exit_code)
        seen = seen.__cause__ or seen.__context__
    return None


def timed_out(error: BaseException) -> bool:
    """Whether ``error``, or one in its chain, is a collective that waited out the process group's timeout
    (gloo says "Application timeout caused pair closure" or "Timed out waiting ..."; NCCL's watchdog ends
    the process instead)."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, RuntimeError) and "timeout" in str(seen).lower().replace("timed out", "timeout"):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


#: /proc/<pid>/stat states of a process that cannot answer: stopped, stopped by a tracer, in a wait the
#: kernel does not interrupt (a hung file system or device).
STUCK_STATES = {
    "T": "is stopped (SIGSTOP, or a debugger)",
    "t": "is stopped by a debugger",
    "D": ("is in a wait the kernel does not interrupt (a hung file system or device)"),
}


def stuck_ranks(children: list[tuple[int, int]] | None = None) -> list[str]:
    """Of the ranks this process started or watches beside it (``(rank, pid)`` pairs; by default those it
    watches), those that the kernel shows stopped or in an uninterruptible wait, in words: ``rank 1 (pid
    4242) is stopped ...``."""
    pairs = children if children is not None else [(r, p.pid) for r, p in _state.children] + _state.local
    found = []
    for rank, pid in pairs:
        stat = _proc_stat(pid)  # None: gone, or no /proc (not Linux)
        if stat is not None and stat.state in STUCK_STATES:
            found.append(f"rank {rank} (pid {pid}) {STUCK_STATES[stat.state]}")
    return found


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def continue_command(argv: list[str] | None = None, launcher_argv: list[str] | None = None) -> str:
    """The command that continues this run: the one typed, with ``resume=auto`` for any ``resume=`` it had.
    A rank Lightning started has three overrides appended to the command (the run directory, the job's
    name, no output subdirectory): they are left out. A rank torchrun started is continued by the same
    torchrun command (``launcher_argv``: torchrun's own command line, by default read from its process, this
    one's parent); on several nodes, each node's with ``resume=auto``."""
    args = list(sys.argv if argv is None else argv)
    rest = args[1:]
    if len(rest) >= 3 and rest[-2].startswith("hydra.job.name=train_ddp_process_"):
        rest = rest[:-3]
    rest = [a for a in rest if a.lstrip("+").split("=", 1)[0] != "resume"]
    if launcher_argv is None and argv is None and external_launcher() is TORCHRUN:
        launcher_argv = _parent_command()
    prefix = ["python"]
    if launcher_argv is not None or (argv is None and external_launcher() is TORCHRUN):
        prefix = torchrun_prefix(launcher_argv or [], args[0])
    return shlex.join([*prefix, args[0], *rest, "resume=auto"])


def _parent_command() -> list[str] | None:
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return None
    return [item.decode(errors="replace") for item in raw.split(b"\0") if item]


def torchrun_prefix(launcher_argv: list[str], script: str) -> list[str]:
    """The part of torchrun's command line before the training script, as typed (``torchrun ...`` or
    ``python -m torch.distributed.run ...``); where it cannot be read, torchrun with this run's shape."""
    for i, arg in enumerate(launcher_argv):
        typed = None
        if arg == "torch.distributed.run" and i > 0 and launcher_argv[i - 1] == "-m":
            typed = ["python", "-m", "torch.distributed.run"]
        elif os.path.basename(arg) == "torchrun":
            typed = ["torchrun"]
        if typed is not None and script in launcher_argv[i + 1 :]:
            end = launcher_argv.index(script, i + 1)
            return [*typed, *launcher_argv[i + 1 : end]]
    nodes, per_node = os.environ.get("GROUP_WORLD_SIZE", "1"), os.environ.get("LOCAL_WORLD_SIZE", "1")
    return ["torchrun", f"--nnodes={nodes}", f"--nproc_per_node={per_node}"]


class WatchedLauncher(_SubprocessScriptLauncher):
    """Lightning's launcher that re-runs the command line for ranks 1..N-1 of a node, with this module's
    watches in place of Lightning's observer: rank 0 watches the processes it started, and each of them
    watches rank 0."""

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        env = self.cluster_environment
        env.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        node_first = env.node_rank() * self.num_processes
        world = self.num_processes * self.num_nodes
        if not env.creates_processes_externally:
            os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
            try:
                self._call_children_scripts()
            finally:
                del os.environ[LAUNCHER_PID_ENV]  # for these children only, not for any started later
            if self.procs:
                watch_children(self.procs, node_first + 1, world)
        else:
            launcher = os.environ.get(LAUNCHER_PID_ENV)
            beside = external_launcher()
            if launcher and (os.getppid() == int(launcher) or not pid_alive(int(launcher))):
                watch_launcher(int(launcher), node_first, world)
            elif beside is not None and not launcher:
                watch_ranks_beside(beside, env.global_rank(), world, self.num_processes)
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)


class WatchedRanks:
    """Mixin for a Lightning strategy whose ranks on a node are started by re-running the command line:
    they run under :class:`WatchedLauncher`."""

    _launcher: _Launcher | None

    def _configure_launcher(self) -> None:
        super()._configure_launcher()  # type: ignore[misc]
        launcher = self._launcher
        if type(launcher) is _SubprocessScriptLauncher:
            self._launcher = WatchedLauncher(
                launcher.cluster_environment, launcher.num_processes, launcher.num_nodes
            )
        elif launcher is None and (os.environ.get(LAUNCHER_PID_ENV) or external_launcher()):
            # A rank started by re-running the command line, or by torchrun or SLURM, under a strategy that
            # gives such a rank no launcher (ModelParallelStrategy): it gets one, which only starts its watch.
            strategy: Any = self
            self._launcher = WatchedLauncher(
                strategy.cluster_environment, strategy.num_processes, strategy.num_nodes
            )


class WatchedDDPStrategy(WatchedRanks, DDPStrategy):
    """Lightning's DDPStrategy with the ranks it starts on a node watched (:class:`WatchedLauncher`)."""
