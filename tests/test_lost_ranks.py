"""A rank lost from a distributed run (CPU processes, gloo): a rank that is killed stops the run with its
name (also while the ranks hash a sharded checkpoint between them, and under torchrun), a killed rank 0 leaves
no rank behind, and the command that continues the run is the one typed. Faults are injected by
tests/faults.py. Apart from tests/test_distributed_faults.py (faults on one rank of a run that goes on) so
that the two files run side by side on two workers."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import ROOT, TINY, run_train
from test_distributed_faults import FAULTS, _checkpoint_step
from test_strategies import CPU2, QUIET, _free_port

from gptlab.runs import digests
from gptlab.runs.layout import last_checkpoint


def processes_of(run_dir: Path) -> list[int]:
    """The pids of the live processes whose command line names ``run_dir`` (a run's ranks)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().decode(errors="replace")
            state = (cmdline.parent / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if str(run_dir) in text and state != "Z":
            found.append(int(cmdline.parent.name))
    return found


@contextmanager
def no_rank_left_behind(run_dir: Path):
    """Asserts, on the way out, that no process of the run is left; kills any that is (a failed test leaves
    no orphan on the machine either)."""
    try:
        yield
    finally:
        left = processes_of(run_dir)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert not left, f"processes of the run left behind: {left}"


def two_ranks(strategy: str, max_steps: int, tmp_path: Path, run_dir: Path) -> list[str]:
    """The overrides of a tiny run on 2 CPU processes under ``strategy``: a last.ckpt every 2 steps, one
    validation at the end, CSV logs."""
    return [
        *TINY,
        *QUIET,
        f"strategy={strategy}",
        *CPU2,
        f"trainer.max_steps={max_steps}",
        "callbacks.last_checkpoint.every_n_train_steps=2",
        f"trainer.val_check_interval={max_steps}",
        "logger=csv",
        f"paths.root_dir={tmp_path}",
        f"hydra.run.dir={run_dir}",
    ]


def run_with_fault(fault: str, args: list[str], tmp_path: Path, run_dir: Path) -> subprocess.CompletedProcess:
    """``tests/faults.py <args>`` with ``fault`` injected, checked to leave no process of the run behind (a
    rank left waiting would hang until the 300 s timeout)."""
    with no_rank_left_behind(run_dir):
        return run_train(
            args, cwd=tmp_path, script=FAULTS, env={"GPTLAB_TEST_FAULT": fault}, check=False, timeout=300
        )


def failure_message(stderr: str) -> str:
    found = re.findall(r"^gptlab: training failed: (.*)$", stderr, flags=re.MULTILINE)
    assert len(found) == 1, stderr[-3000:]
    return found[0]


@pytest.mark.slow
def test_a_killed_rank_stops_the_run_with_its_name_and_resume_auto_finishes_it(tmp_path):
    run_dir = tmp_path / "run"
    common = two_ranks("ddp", 6, tmp_path, run_dir)
    # Rank 1 is SIGKILLed after its third step (the out-of-memory killer's way); rank 0's next collective
    # fails (over gloo), or, where it would wait on (NCCL), its watcher ends it (the next test's way).
    proc = run_with_fault("die_at_step:1:3", common, tmp_path, run_dir)
    assert proc.returncode == 1, proc.stderr[-3000:]
    message = failure_message(proc.stderr)
    assert re.match(
        r"Rank 1 of 2 \(pid \d+\) was killed by SIGKILL \(signal 9\) at step 3: the run cannot go on without "
        r"it, and stopped\. SIGKILL is what the kernel's out-of-memory killer sends",
        message,
    ), message
    last = last_checkpoint(run_dir)
    assert f"The last intact checkpoint is {last} (step 2); continue from it with: " in message
    assert _checkpoint_step(last) == 2
    command = message.rsplit("continue from it with: ", 1)[1]
    assert shlex.split(command) == ["python", str(FAULTS), *common, "resume=auto"]
    assert "Traceback" not in proc.stderr  # gloo's "Connection reset by peer" is not shown
    result = json.loads((run_dir / "result.json").read_text())
    assert result["failed"] == f"RankLostError: {message}"
    assert not result["finished"] and result["global_step"] == 3
    assert [p["status"] for p in result["parts"]] == ["failed"]

    # The command it prints continues from step 2 and finishes (train.py in place of the fault script).
    assert_finished_from_step_2(run_train([*common, "resume=auto"], cwd=tmp_path), run_dir)


@pytest.mark.slow
def test_a_rank_killed_while_the_ranks_hash_a_sharded_checkpoint_stops_the_run_with_its_name(tmp_path):
    run_dir = tmp_path / "run"
    common = two_ranks("fsdp", 4, tmp_path, run_dir)
    # Rank 1 dies as it starts hashing its share of step 2's last.ckpt; rank 0 has hashed its own and waits
    # for rank 1's digests in the exchange, which fails over gloo: the run stops, no rank waits on.
    proc = run_with_fault("die_in_hashing:1", common, tmp_path, run_dir)
    assert proc.returncode == 1, proc.stderr[-3000:]
    message = failure_message(proc.stderr)
    assert re.match(r"Rank 1 of 2 \(pid \d+\) was killed by SIGKILL \(signal 9\) at step 2", message), message
    assert "No checkpoint was written before it" in message
    # The save stopped before its swap: no last.ckpt, and no digest describing bytes that are not there.
    checkpoints = run_dir / "checkpoints"
    assert not (checkpoints / "last.ckpt").exists()
    assert not digests.digest_path(checkpoints / "last.ckpt").exists()


@pytest.mark.slow
def test_the_rank_a_killed_rank_0_started_stops_and_says_why(tmp_path):
    run_dir = tmp_path / "run"
    common = two_ranks("fsdp", 6, tmp_path, run_dir)
    # Rank 0 is SIGKILLed after its third step, and rank 1's main thread then waits for ever, as in an NCCL
    # collective (over gloo it would fail at once): rank 1's watcher sees its parent gone and ends it. The
    # run returns only once rank 1 has closed the output it shares with rank 0.
    proc = run_with_fault("die_at_step:0:3:hang", common, tmp_path, run_dir)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    message = failure_message(proc.stderr)
    assert re.match(
        r"Rank 0 of 2 \(pid \d+\), which started this process, ended \(how, only its parent could tell\) at "
        r"step 3: rank 1 cannot go on without it, and stopped\.",
        message,
    ), message
    last = last_checkpoint(run_dir)
    assert f"The last intact checkpoint is {last} (step 2)" in message
    assert shlex.split(message.rsplit("with: ", 1)[1]) == ["python", str(FAULTS), *common, "resume=auto"]


@pytest.mark.slow
def test_a_rank_0_killed_while_it_writes_a_checkpoint_in_the_background_leaves_the_one_before_named(tmp_path):
    run_dir = tmp_path / "run"
    common = two_ranks("ddp", 8, tmp_path, run_dir)
    # Rank 0 dies while its writer thread holds step 4's last.ckpt, unwritten, after the ranks trained step 5:
    # rank 1, which took part in that save, must not name it, but the one on disk whole (step 2's: the save of
    # step 4 waited for it).
    proc = run_with_fault("kill_in_background_write:4", common, tmp_path, run_dir)
    assert proc.returncode != 0, proc.stderr[-3000:]
    message = failure_message(proc.stderr)
    assert re.match(r"Rank 0 of 2 \(pid \d+\), which started this process, ended", message), message
    last = last_checkpoint(run_dir)
    assert f"The last intact checkpoint is {last} (step 2)" in message
    assert _checkpoint_step(last) == 2 and digests.check(last).verified
    assert not list((run_dir / "checkpoints").glob(".last.ckpt.tmp-*"))  # killed before its first byte


def torchrun(port: int, script: Path, args: list[str], cwd: Path, env: dict | None = None):
    """``python -m torch.distributed.run`` (torchrun) with 2 ranks on this machine running ``script``."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}"]
    return subprocess.run(
        [*launcher, str(script), *args],
        cwd=cwd,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,  # a rank left waiting would hang until this
    )


@pytest.mark.slow
@pytest.mark.parametrize("killed", [1, 0])
def test_a_rank_killed_under_torchrun_is_named_recorded_and_the_torchrun_command_resumes(tmp_path, killed):
    run_dir = tmp_path / "run"
    # Checkpoints written before the next step: step 2's is on disk when rank 0 dies at step 3 (in the
    # background it could still be in flight; the next test kills rank 0 there).
    common = [*two_ranks("ddp", 6, tmp_path, run_dir), "callbacks.last_checkpoint.background=false"]
    port = _free_port()
    # The rank is SIGKILLed after its third step; torchrun's agent then sends SIGTERM to the other, whose
    # collective with it fails (over gloo) and whose watch of the rank beside it says which one is gone.
    with no_rank_left_behind(run_dir):
        proc = torchrun(port, FAULTS, common, tmp_path, env={"GPTLAB_TEST_FAULT": f"die_at_step:{killed}:3"})
    assert proc.returncode == 1, proc.stderr[-3000:]
    message = failure_message(proc.stderr)  # the survivor's, once
    found = re.match(
        rf"Rank {killed} of 2 \(pid (\d+)\), started beside this one by torchrun, ended \(how, torchrun's "
        r"summary says: its exitcode, printed as torchrun stops\) at step 3: "
        rf"{'the run' if killed else 'rank 1'} cannot go on without it, and stopped\. SIGKILL \(exit code -9",
        message,
    )
    assert found, message
    # torchrun's summary names the same process, killed by SIGKILL
    summary = rf"rank\s*: {killed} \(local_rank: {killed}\)\s*exitcode\s*: -9 \(pid: {found[1]}\)"
    assert re.search(summary, proc.stderr), proc.stderr[-3000:]
    last = last_checkpoint(run_dir)
    assert f"The last intact checkpoint is {last} (step 2); continue from it with: " in message
    assert _checkpoint_step(last) == 2
    command = shlex.split(message.rsplit("continue from it with: ", 1)[1])
    launcher = ["python", "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}"]
    assert command == [*launcher, str(FAULTS), *common, "resume=auto"]
    # result.json says so, written by rank 0, or by rank 1 in its place where rank 0 is the one lost
    result = json.loads((run_dir / "result.json").read_text())
    assert result["failed"] == f"RankLostError: {message}"
    assert not result["finished"] and result["global_step"] == 3
    if killed == 1:
        return  # the resume is the same either way; run once (below, also past rank 0's abandoned claim)

    # The command it prints continues from step 2 and finishes (train.py in place of the fault script).
    proc = torchrun(_free_port(), ROOT / "train.py", [*common, "resume=auto"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_finished_from_step_2(proc, run_dir)


LOST_WHILE_WAITING = """
import subprocess, sys, threading
from gptlab.parallel import ranks

segfault = "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"
children = [subprocess.Popen([sys.executable, "-c", code]) for code in (segfault, "import time; time.sleep(600)")]
print("waiting", children[1].pid, flush=True)
ranks.set_reporter(lambda lost: lost.summary(), lambda error: print("recorded", error, flush=True))
ranks.watch_children(children, first_rank=1, world_size=3, grace_s=1.0)
threading.Event().wait()  # the main thread waits on, as in an NCCL collective whose peer is gone
"""


@pytest.mark.slow
def test_a_watcher_reports_a_lost_rank_where_the_main_thread_waits_on(tmp_path):
    script = tmp_path / "lost.py"
    script.write_text(LOST_WHILE_WAITING)
    proc = subprocess.run(
        [sys.executable, str(script)],
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    waiting = int(lines[0].split()[1])
    # The lost rank named and how it ended, recorded by the task's recorder and printed, and the rank still
    # waiting killed (it could only wait for the lost one).
    assert re.fullmatch(r"recorded Rank 1 of 3 \(pid \d+\) was killed by SIGSEGV \(signal 11\)", lines[1])
    assert lines[1].removeprefix("recorded ") in failure_message(proc.stderr)
    assert (
        not Path(f"/proc/{waiting}").exists() or "Z" in Path(f"/proc/{waiting}/stat").read_text().split()[2]
    )


def test_a_stopped_rank_is_named_when_a_collective_times_out():
    from gptlab.parallel.ranks import stuck_ranks, timed_out

    # gloo's words for a collective that waited out the process group's timeout
    assert timed_out(RuntimeError("Application timeout caused pair closure"))
    assert timed_out(RuntimeError("[../gloo/transport/tcp/pair.cc:446] Timed out waiting 20000ms for recv"))
    assert not timed_out(RuntimeError("Connection reset by peer"))
    # a collective whose connection to a rank on another node broke (gloo), named as such under torchrun
    from gptlab.parallel.ranks import peer_lost

    closed = RuntimeError(
        "[../pair.cc:553] Connection closed by peer [127.0.0.1]:11418. This is typically ..."
    )
    assert peer_lost(closed) and peer_lost(RuntimeError("Read error: Connection reset by peer"))
    assert not peer_lost(RuntimeError("Application timeout caused pair closure"))
    stopped, running = (subprocess.Popen(["sleep", "60"]) for _ in range(2))
    try:
        stopped.send_signal(signal.SIGSTOP)

        def state(pid: int) -> str:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]

        deadline = time.monotonic() + 60  # the kernel stops it at once; the state reads so at once
        while state(stopped.pid) != "T":
            assert time.monotonic() < deadline, "the process was not stopped"
        # the other one asleep in its timer: a process just started on a loaded machine may still be loading
        # its pages from disk, an uninterruptible wait (D) for a moment, which is what the check reports
        while state(running.pid) != "S":
            assert time.monotonic() < deadline, "the process did not reach its sleep"
        assert stuck_ranks([(1, stopped.pid), (2, running.pid)]) == [
            f"rank 1 (pid {stopped.pid}) is stopped (SIGSTOP, or a debugger)"
        ]
    finally:
        for proc in (stopped, running):
            proc.kill()
            proc.wait()


def test_a_rank_that_ddp_spawn_reports_ended_is_named_as_a_watched_one():
    from torch.multiprocessing import ProcessExitedException

    from gptlab.parallel.ranks import spawned_rank_lost

    # what torch.multiprocessing's join raises in the launching process (its message and fields)
    report = ProcessExitedException("process 1 terminated with signal SIGKILL", 1, 4242, -9, "SIGKILL")
    try:
        raise RuntimeError("while fitting") from report
    except RuntimeError as e:
        lost = spawned_rank_lost(e, world_size=2)
    assert lost is not None and lost.summary() == "Rank 1 of 2 (pid 4242) was killed by SIGKILL (signal 9)"
    assert spawned_rank_lost(RuntimeError("Connection reset by peer"), world_size=2) is None


def test_the_command_that_continues_a_run_is_the_one_typed_with_resume_auto():
    from gptlab.parallel.ranks import LostRank, continue_command

    typed = ["train.py", "model=small", "resume=outputs/runs/a", "hydra.run.dir=outputs/runs/a b"]
    assert (
        continue_command(typed) == "python train.py model=small 'hydra.run.dir=outputs/runs/a b' resume=auto"
    )
    # a rank Lightning started: the three overrides it appended are not the user's
    started = [
        *typed,
        'hydra.run.dir="outputs/runs/a b"',
        "hydra.job.name=train_ddp_process_1",
        "hydra.output_subdir=null",
    ]
    assert continue_command(started) == continue_command(typed)
    # a rank torchrun started: the torchrun command as typed (its own command line, its parent's)
    console_script = ["/venv/bin/python", "/venv/bin/torchrun", "--nproc_per_node=8", *typed]
    assert continue_command(typed, launcher_argv=console_script) == (
        "torchrun --nproc_per_node=8 train.py model=small 'hydra.run.dir=outputs/runs/a b' resume=auto"
    )
    module = ["python3", "-m", "torch.distributed.run", "--nnodes=2", "--node_rank=1", *typed]
    assert continue_command(typed, launcher_argv=module).startswith(
        "python -m torch.distributed.run --nnodes=2 --node_rank=1 train.py model=small"
    )
    assert LostRank(2, 4, 99, 3).how() == "exited with status 3"
    assert LostRank(2, 4, 99, -6).how() == "was killed by SIGABRT (signal 6)"


def assert_finished_from_step_2(proc, run_dir) -> None:
    """A run that failed at step 3, resumed from its step-2 checkpoint to its end at step 6."""
    assert "Restored all states from the checkpoint" in proc.stdout + proc.stderr
    assert "Trained 6 steps; this part, resumed at step 2, trained 4" in proc.stdout
    result = json.loads((run_dir / "result.json").read_text())
    assert result["finished"] and result["global_step"] == 6
    assert [(p["from_step"], p["to_step"], p["status"]) for p in result["parts"]] == [
        (0, 3, "failed"),
        (2, 6, "finished"),
    ]
