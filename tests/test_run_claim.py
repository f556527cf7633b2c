"""One running process per run directory: two runs started at once into one directory (one goes on, one is
refused by name, nothing of the survivor's is mixed or garbled), two default directories taken in the same
second, a claim left by a killed process, a start that failed before training, and an online W&B logger
that cannot log, refused before the run starts."""

from __future__ import annotations

import csv
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import ROOT, TINY, run_train

from gptlab.errors import ConfigError
from gptlab.runs import Run
from gptlab.runs.identity import Claim, RunDirectoryClaimed, RunDirectoryInUse, hold_run_dir, release_run_dir
from gptlab.runs.layout import CLAIM_FILE, REPLACED_DIR
from gptlab.tracking import wandb_check

FAST = [*TINY, "tokenizer=char", "trainer.val_check_interval=2", "trainer.log_every_n_steps=1", "logger=csv"]


def start(tmp_path: Path, overrides: list[str], fault: str) -> subprocess.Popen:
    """`python tests/faults.py <overrides>` (train.py with the fault ``fault``), started, not awaited."""
    return subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "faults.py"), *FAST, f"paths.root_dir={tmp_path}", *overrides],
        cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "GPTLAB_TEST_FAULT": fault},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def first_to_end(procs: list[subprocess.Popen], timeout: float = 600) -> subprocess.Popen:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                return proc
        time.sleep(0.05)
    for proc in procs:
        proc.kill()
    raise AssertionError("neither process ended")


def race(tmp_path: Path, name: str, overrides: list[str]) -> tuple[subprocess.Popen, str, str, str, str]:
    """Two processes with the same ``overrides`` claim the run directory at the same moment; the one that got
    through waits until the other has ended. Returns (winner, its stdout, its stderr, the loser's stderr,
    and the loser's pid as text)."""
    sync = tmp_path / f"sync-{name}"
    sync.mkdir()
    procs = [start(tmp_path, overrides, f"race_start:{sync}:2:hold") for _ in range(2)]
    loser = first_to_end(procs)
    _, loser_err = loser.communicate()
    (sync / "go").touch()
    (winner,) = [p for p in procs if p is not loser]
    out, err = winner.communicate(timeout=600)
    assert loser.returncode == 2, loser_err[-3000:]
    assert winner.returncode == 0, err[-3000:]
    return winner, out, err, loser_err, str(loser.pid)


def metrics_rows(run_dir: Path) -> list[dict[str, str]]:
    """metrics.csv's rows, checked whole: every row has the header's columns, no more, no fewer."""
    with (run_dir / "csv" / "metrics.csv").open(newline="") as f:
        reader = csv.reader(f)
        header = next(reader)
        rows = list(reader)
    assert rows and all(len(row) == len(header) for row in rows), "metrics.csv is garbled"
    return [dict(zip(header, row, strict=True)) for row in rows]


def trained_steps(rows: list[dict[str, str]]) -> list[int]:
    return [int(r["step"]) for r in rows if r.get("train/loss")]


@pytest.mark.slow
def test_two_runs_started_together_into_one_directory_one_runs_and_the_other_is_refused(tmp_path):
    run_dir = tmp_path / "D"
    winner, out, _, refused, _ = race(tmp_path, "new", ["trainer.max_steps=2", f"hydra.run.dir={run_dir}"])
    assert f"gptlab: error: {run_dir} is in use: process {winner.pid} on {socket.gethostname()}" in refused
    assert "hydra.run.dir=<another dir>" in refused and "resume=auto" in refused
    assert "Traceback" not in refused
    # the survivor's run is whole and its own: one run, one part, a clean curve to its last step
    info = Run(run_dir).info()
    assert len(info.parts) == 1 and info.parts[0]["pid"] == winner.pid
    assert Run(run_dir).result()["finished"] and Run(run_dir).result()["run_id"] == info.run_id
    assert trained_steps(metrics_rows(run_dir)) == [1, 2]
    assert not (run_dir / REPLACED_DIR).exists() and not (run_dir / CLAIM_FILE).exists()

    # two resumes of that run at once: one continues it, the other is refused
    winner, _, _, refused, _ = race(
        tmp_path, "resume", ["trainer.max_steps=4", f"hydra.run.dir={run_dir}", "resume=auto"]
    )
    assert f"{run_dir} is in use: process {winner.pid}" in refused and "Traceback" not in refused
    info = Run(run_dir).info()
    assert [p["resumed"] for p in info.parts] == [False, True] and info.parts[1]["pid"] == winner.pid
    assert Run(run_dir).result()["global_step"] == 4
    # one continuation's rows after the first part's, none twice (two resumes would have logged 4 more)
    steps = trained_steps(metrics_rows(run_dir))
    assert steps[:2] == [1, 2] and len(steps) == 4 and steps == sorted(set(steps))


@pytest.mark.slow
def test_two_default_run_directories_taken_in_the_same_second_both_run(tmp_path):
    # The default run directory, named by a second both runs share: the same resolver, the same name.
    same = "outputs/runs/2026-01-01/00-00-00"
    run_dir = f"hydra.run.dir='${{gptlab_run_dir:${{hydra.overrides.task}},outputs,{same}}}'"
    sync = tmp_path / "sync"
    sync.mkdir()
    procs = [start(tmp_path, ["trainer.max_steps=2", run_dir], f"race_start:{sync}:2") for _ in range(2)]
    ended = [(p, *p.communicate(timeout=600)) for p in procs]
    for proc, _, err in ended:
        assert proc.returncode == 0, err[-3000:]
    dirs = [tmp_path / same, tmp_path / f"{same}-1"]
    assert sorted(p.name for p in dirs[0].parent.iterdir()) == ["00-00-00", "00-00-00-1"]
    assert {Run(d).info().parts[0]["pid"] for d in dirs} == {p.pid for p in procs}
    for proc, out, _ in ended:
        (mine,) = [d for d in dirs if Run(d).info().parts[0]["pid"] == proc.pid]
        assert f"Run directory: {mine}\n" in out + err
    for d in dirs:
        assert Run(d).result()["finished"] and trained_steps(metrics_rows(d)) == [1, 2]


def test_a_claim_left_by_a_killed_process_is_taken_over(tmp_path, caplog):
    run_dir = tmp_path / "D"
    # a process that claims the directory and is killed: its run.lock stays, its pid is gone
    holder = (
        "import os, signal; from pathlib import Path; from gptlab.runs.identity import hold_run_dir; "
        f"hold_run_dir(Path({str(run_dir)!r})); os.kill(os.getpid(), signal.SIGKILL)"
    )
    killed = subprocess.Popen(
        [sys.executable, "-c", holder], env={**os.environ, "PYTHONPATH": str(ROOT / "src")}
    )
    assert killed.wait(timeout=600) == -signal.SIGKILL
    left = Claim.read(run_dir / CLAIM_FILE)
    assert left is not None and left.pid == killed.pid
    with caplog.at_level("WARNING"):
        claim = hold_run_dir(run_dir)
    try:
        assert claim.pid == os.getpid() and Claim.read(run_dir / CLAIM_FILE) == claim
        assert f"taking over the claim of a run whose process is gone (process {left.pid} on" in caplog.text
    finally:
        release_run_dir(run_dir)


# ---- in one process: the claim's rules ------------------------------------------------------------------


def holding_process(run_dir: Path) -> subprocess.Popen:
    """A live process that holds ``run_dir``'s claim until its stdin closes."""
    code = (
        "import sys; from pathlib import Path; from gptlab.runs.identity import hold_run_dir; "
        f"hold_run_dir(Path({str(run_dir)!r})); print('held', flush=True); sys.stdin.read()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_live_claim_refuses_and_names_the_process_and_a_released_one_frees_the_directory(tmp_path):
    run_dir = tmp_path / "D"
    holder = holding_process(run_dir)
    try:
        with pytest.raises(RunDirectoryClaimed) as refused:
            hold_run_dir(run_dir)
        message = str(refused.value)
        assert isinstance(refused.value, ConfigError)
        assert f"{run_dir} is in use: process {holder.pid} on {socket.gethostname()}" in message
        assert "hydra.run.dir=<another dir>" in message and "resume=auto" in message
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert not (run_dir / CLAIM_FILE).exists()  # the holder released it as it ended
    claim = hold_run_dir(run_dir)
    assert hold_run_dir(run_dir) == claim  # held already: the same claim
    assert Claim.read(run_dir / CLAIM_FILE) == claim and claim.pid == os.getpid()
    release_run_dir(run_dir)
    assert not (run_dir / CLAIM_FILE).exists()


def test_a_claim_is_not_taken_on_a_rank_a_launcher_started(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert hold_run_dir(tmp_path / "D") is None and not (tmp_path / "D" / CLAIM_FILE).exists()


@pytest.mark.slow
def test_a_start_that_failed_before_training_leaves_the_directory_free(make_cfg, tmp_path, monkeypatch):
    from gptlab.tasks import gpt
    from gptlab.tracking.wandb_runs import find_runs

    run_dir = tmp_path / "D"
    cfg = [
        *TINY,
        "tokenizer=char",
        "trainer.max_steps=1",
        "logger=[csv,wandb]",
        f"paths.output_dir={run_dir}",
    ]

    def broken_trainer(cfg, settings, parts, loggers):
        for logger in loggers:
            assert logger.experiment is not None  # opened: the W&B run and the CSV folder are written
        raise RuntimeError("no trainer today")

    # the first start opens its loggers and fails building the trainer
    monkeypatch.setattr(gpt, "make_trainer", broken_trainer)
    with pytest.raises(RuntimeError, match="no trainer today"):
        gpt.run(make_cfg(*cfg))
    failed = json.loads((run_dir / "result.json").read_text())
    assert failed["global_step"] == 0 and not failed["finished"] and len(find_runs(run_dir / "wandb")) == 1
    monkeypatch.undo()
    # the same command again: it runs, and the failed start's files are set aside whole, not mixed in
    gpt.run(make_cfg(*cfg))
    assert Run(run_dir).result()["finished"] and len(find_runs(run_dir / "wandb")) == 1
    (aside,) = (run_dir / REPLACED_DIR).iterdir()
    assert json.loads((aside / "result.json").read_text()) == failed and len(find_runs(aside / "wandb")) == 1
    assert Run(run_dir).info().run_id != json.loads((aside / "run.json").read_text())["run_id"]
    # a run that trained is no failed start: the same command is refused
    with pytest.raises(RunDirectoryInUse, match=f"{run_dir} already holds a run"):
        gpt.run(make_cfg(*cfg))


# ---- W&B online without a usable key ------------------------------------------------------------------


@pytest.fixture
def no_wandb_login(tmp_path, monkeypatch):
    """A home without W&B credentials, online mode asked for."""
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "home" / "wandb"))
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setattr(wandb_check, "_working", set())
    return tmp_path


def test_wandb_online_without_a_key_is_refused_in_seconds_and_leaves_the_directory_free(no_wandb_login):
    tmp_path = no_wandb_login
    run_dir = tmp_path / "D"
    args = [*FAST, "logger=wandb", f"paths.root_dir={tmp_path}", f"hydra.run.dir={run_dir}"]
    for _ in range(2):  # the same command again: refused for the same reason, not for "already holds a run"
        proc = run_train(args, cwd=tmp_path, check=False)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert (
            "gptlab: error: W&B is to log online (WANDB_MODE=online) but no W&B API key is set" in proc.stderr
        )
        assert (
            "`wandb login`" in proc.stderr
            and "logger=csv" in proc.stderr
            and "WANDB_MODE=offline" in proc.stderr
        )
        # refused before Hydra made the run directory, so before the task that would call wandb.init (which
        # took ~20 s to fail, ~90 s to give up): what is left is the process's start-up, which no wall-clock
        # bound can hold on a loaded machine
        assert not run_dir.exists()


class SilentHandler(http.server.BaseHTTPRequestHandler):
    """A server that takes the request and never answers (as a blocked or overloaded W&B host does)."""

    def do_POST(self) -> None:
        self.server.got_request.set()  # type: ignore[attr-defined]
        self.server.release.wait(30)  # type: ignore[attr-defined]

    def log_message(self, *args) -> None:
        pass


def test_wandb_online_with_a_key_is_checked_within_a_bound(no_wandb_login, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    # nothing listens: refused at once
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    with pytest.raises(
        ConfigError, match=r"http://127.0.0.1:9 cannot be reached.*logger=csv.*WANDB_MODE=offline"
    ):
        wandb_check.check_wandb_online("auto")
    # a server that never answers: refused when the bound runs out, not after wandb's 90 s
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), SilentHandler)
    server.got_request, server.release = threading.Event(), threading.Event()  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.server_address[1]}")
    try:
        t0 = time.monotonic()
        with pytest.raises(ConfigError, match=r"did not answer within 1 s.*`wandb login`"):
            wandb_check.check_wandb_online("online", timeout=1.0)
        assert time.monotonic() - t0 < 30 and server.got_request.is_set()
    finally:
        server.release.set()
        server.shutdown()
    # offline and disabled need no key and ask no server; auto without a key is offline
    wandb_check.check_wandb_online("offline")
    wandb_check.check_wandb_online("disabled")
    monkeypatch.delenv("WANDB_API_KEY")
    monkeypatch.delenv("WANDB_MODE")
    assert wandb_check.wandb_mode("auto") == "offline"
    wandb_check.check_wandb_online("auto")
