from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

ROOT = Path(__file__).resolve().parents[1]


#: ``@pytest.mark.parametrize("device", CPU_AND_CUDA)``: a test on the CPU, and on a CUDA device (a gpu test)
CPU_AND_CUDA = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]


def assert_cached_decoding_is_the_whole_pass(model, new_tokens: int) -> None:
    """A prompt, a chunk and then one token at a time over a KV cache give the logits of one pass over the
    whole sequence (14 tokens, in ``model``'s vocabulary of at least 61), and greedy generation of
    ``new_tokens`` is the same with the cache and without."""
    from gptlab.model import KVCache

    idx = torch.randint(0, 61, (2, 14))
    whole = model(idx)[0]
    cache = KVCache.empty(model.config.n_layer)
    steps = [model(idx[:, :6], cache=cache)[0], model(idx[:, 6:9], cache=cache)[0]]
    steps += [model(idx[:, t : t + 1], cache=cache)[0] for t in range(9, 14)]
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=0, atol=1e-5)
    prompt = idx[:, :5]
    assert torch.equal(
        model.generate(prompt, new_tokens, use_cache=True),
        model.generate(prompt, new_tokens, use_cache=False),
    )


def strict_json(path: Path):
    """``path`` parsed as a strict reader (jq, JavaScript's JSON.parse) parses it: a bare NaN or Infinity
    token, which Python's json writes and reads, is refused."""
    import json

    def refuse(token: str):
        raise ValueError(f"{path} holds {token}, which is not JSON")

    return json.loads(Path(path).read_text(), parse_constant=refuse)


def strict_json_lines(path: Path) -> list:
    """``path`` as JSON Lines, each line parsed as :func:`strict_json` parses a file."""
    import json

    def refuse(token: str):
        raise ValueError(f"{path} holds {token}, which is not JSON")

    return [json.loads(line, parse_constant=refuse) for line in Path(path).read_text().splitlines()]


def load_script(name: str):
    """``scripts/<name>.py`` imported as the module ``name`` (scripts are not a package), registered in
    ``sys.modules`` so that its dataclasses and pickling resolve; the caller removes it when done."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


CONF = ROOT / "conf"

# gensim, a dependency of gptlab, reads the word2vec text format and ships the word-similarity and analogy
# benchmarks that task=word2vec evaluates on. An environment without it (a GPU image given only the wheels that
# gptlab's GPU paths need) skips the tests that need it and runs the rest.
needs_gensim = pytest.mark.skipif(
    importlib.util.find_spec("gensim") is None, reason="needs gensim (word2vec's reader and benchmarks)"
)

# Tests never touch the network or a real W&B account.
os.environ["WANDB_MODE"] = "offline"
os.environ["WANDB_SILENT"] = "true"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def threads_per_process() -> int:
    """torch threads for each process of the suite: in a pytest-xdist worker, the cores shared out among the
    workers (one each on 2 cores with `-n auto`); at most 2 (a tiny model gains nothing from more). A test's
    `python train.py` runs while its worker waits, beside the other workers: on 2 cores with 2 threads each,
    OpenMP's threads spin waiting for a core another process holds. A tiny 30-step run in a subprocess beside
    the suite took 17-20 s of CPU with 2 threads and 8 s with 1 (`/usr/bin/time`, OMP_NUM_THREADS=2 against 1,
    twice each)."""
    chosen = os.environ.get("OMP_NUM_THREADS", "")
    if chosen.isdigit() and int(chosen) > 0:  # the caller's choice, which the subprocesses read too
        return int(chosen)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, min(2, len(os.sched_getaffinity(0)) // workers))


torch.set_num_threads(threads_per_process())
if os.environ.get("PYTEST_XDIST_WORKER"):
    # the worker's `python train.py` subprocesses take as many (a value the caller set is kept)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_process()))


# Under pytest-xdist (`pytest` runs `-n auto`, pyproject's addopts) a file's tests stay on one worker, so that
# its module fixtures (a trained run several tests read) are made once; the files that read the session's
# sweep share a worker with it. The files that take longest are handed out first, so that no worker is left
# with a long file at the end: the longest first is the order that ends soonest when long files and many short
# ones share the workers.
SHARED_WORKER = {
    "test_compare.py": "tiny_sweep",
    "test_sweeps.py": "tiny_sweep",
    "test_run_identity.py": "tiny_sweep",
}
# The files (or groups of SHARED_WORKER) that took a minute or more of a worker (the sum of their tests'
# durations under `pytest --durations=0` on a 2-core machine), longest first; the rest follow in collection
# order. test_docs.py comes first whatever its own time: its two runners of the pages' commands start with it
# and work beside the workers.
LONGEST_FIRST = [
    "test_docs.py",
    "test_strategies.py",
    "test_distributed_faults.py",
    "test_resume.py",
    "test_run_identity.py",  # with test_compare.py and test_sweeps.py, which read its sweep
    "test_lost_ranks.py",
    "test_resume_runs.py",
    "test_gpu_check.py",
    "test_harness.py",
    "test_word2vec.py",
    "test_token_files.py",
    "test_api_notebook.py",
    "test_runs.py",
    "test_resume_changes.py",
    "test_eval_length.py",
    "test_flex_compile.py",
    "test_errors.py",
    "test_downstream_eval.py",
    "test_cli.py",
    "test_run_claim.py",
    "test_mtp.py",
    "test_attention_variants.py",
    "test_entry_point.py",
    "test_streaming.py",
    "test_model.py",
    "test_benchmarks.py",
    "test_numbers.py",
    "test_model_card.py",
    "test_api.py",
    "test_moe.py",
    "test_architecture.py",
    "test_positional.py",
]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's scheduling by scope, a scope being a test file (or the files that share the sweep), handed out in
    collection order (the order of ``LONGEST_FIRST``; xdist's own reordering, by the number of tests in a file,
    would start a file of many quick tests before a file of a few long ones); an explicit other ``--dist`` than
    load (scripts/gpu_check.py's ``--dist worksteal``: the gpu tests, most of them in one file and each with its
    own runs, spread over the workers one by one) is left to xdist."""
    if config.getoption("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0]
            return SHARED_WORKER.get(Path(file).name, file)

    return ByFile(config, log)


def pytest_collection_modifyitems(config, items) -> None:
    """The longest files first; tests marked ``gpu`` are skipped, with the reason, on a machine without a CUDA
    device."""

    def order(item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=order)  # stable: a file's tests keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marker gpu); none is visible here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def cache_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("root")


@pytest.fixture
def make_cfg(cache_root):
    """Compose the training config with overrides, as `python train.py <overrides>` would."""

    def _compose(*overrides: str, root: Path | None = None):
        GlobalHydra.instance().clear()
        with initialize_config_dir(str(CONF), version_base="1.3"):
            return compose("train", overrides=[f"paths.root_dir={root or cache_root}", *overrides])

    return _compose


@pytest.fixture(scope="session", autouse=True)
def token_caches_outside_the_checkout(tmp_path_factory) -> None:
    """A run that names no ``paths.root_dir`` (a script, a `python train.py` subprocess) keeps its token cache
    under this session's temporary folder, shared by its xdist workers, instead of the checkout's outputs/
    (``GPTLAB_ROOT``: conf/paths/default.yaml). A ``DataSpec`` made in Python keeps its own default."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # .../pytest-N/popen-gwK: the session's folder is the parent
        base = base.parent
    os.environ.setdefault("GPTLAB_ROOT", str(base / "gptlab-root"))


@pytest.fixture(autouse=True)
def no_hydra_job_left_behind():
    """A test that ran a Hydra job in this process (train.py through runpy, the Python API) leaves no job
    config behind for the next test: HydraConfig would name a finished (or refused) job's run directory."""
    yield
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    HydraConfig.instance().cfg = None
    GlobalHydra.instance().clear()


def torch_settings() -> tuple:
    """What a test might change in this process and a later test's runs depend on, to the last digit."""
    return (
        torch.get_num_threads(),
        torch.get_default_dtype(),
        torch.are_deterministic_algorithms_enabled(),
        torch.get_float32_matmul_precision(),
        torch.is_grad_enabled(),
    )


@pytest.fixture(autouse=True)
def torch_settings_left_as_found(request):
    """A test leaves torch's process-wide settings as it found them: the runs of the next test in the worker
    would otherwise train under them (2 threads sum a product otherwise than 1, in the last digit) while a
    `python train.py` beside them would not."""
    before = torch_settings()
    yield
    after = torch_settings()
    if after != before:
        torch.set_num_threads(before[0])
        torch.set_default_dtype(before[1])
        torch.use_deterministic_algorithms(before[2])
        torch.set_float32_matmul_precision(before[3])
        torch.set_grad_enabled(before[4])
        pytest.fail(f"{request.node.nodeid} changed torch's settings: {before} -> {after}")


def slurm_job(tmp_path: Path, job_id: str = "4242") -> tuple[dict[str, str], Path]:
    """A one-task SLURM job where there is no SLURM controller: the job's environment (``PATH`` first to an
    ``scontrol`` stand-in), and the file in which that stand-in records the arguments of each call."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scontrol_calls.txt"
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (bin_dir / "scontrol").chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": job_id,
        "SLURM_JOB_NAME": "gptlab",
        "SLURM_NTASKS": "1",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_NODELIST": "localhost",
    }
    return env, calls


TINY = [
    "model.n_layer=1",
    "model.n_head=2",
    "model.n_embd=32",
    "model.block_size=32",
    "data.batch_size=4",
    "trainer.max_steps=8",
    "trainer.val_check_interval=4",
    "trainer.limit_val_batches=2",
    "callbacks.sample_generation.max_new_tokens=4",
]


def run_train(
    args: list[str],
    cwd: Path,
    timeout: int = 600,
    env: dict | None = None,
    check: bool = True,
    script: Path = ROOT / "train.py",
    preexec_fn=None,
    start_new_session: bool = False,
) -> subprocess.CompletedProcess:
    """Run `python train.py <args>` as a user would, in a subprocess (``script``: tests/faults.py to inject
    a fault)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run(
        [sys.executable, str(script), *args],
        preexec_fn=preexec_fn,
        start_new_session=start_new_session,
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"train.py failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


# One small real sweep, shared by the tests that read a sweep (test_compare, test_sweeps, test_run_identity):
# `python train.py -m pos=learned,rope activation=gelu,swiglu seed=0,1` with every logger and the length study
# on. A condition is a (pos, activation) pair, with two seeds each. 7 steps, validation every 4: the final
# validation at step 7 comes from the end-of-run check.
SWEEP = [
    *TINY,
    "tokenizer=char",
    "trainer.max_steps=7",
    "trainer.log_every_n_steps=2",
    "eval_length.enabled=true",
    "eval_length.factors=[1,2]",
    "eval_length.max_tokens=512",
    "logger=all",
    "pos=learned,rope",
    "activation=gelu,swiglu",
    "seed=0,1",
]


@pytest.fixture(scope="session")
def tiny_sweep(tmp_path_factory) -> tuple[Path, Path, subprocess.CompletedProcess]:
    """(root, sweep_dir, the finished process) of SWEEP, run once per session as a user runs it. Its run
    directories are shared: read them, or copy them before changing anything (the comparison may write its
    report beside them)."""
    root = tmp_path_factory.mktemp("tiny_sweep")
    sweep_dir = root / "multirun" / "tiny_pos"
    proc = run_train(["-m", *SWEEP, f"paths.root_dir={root}", f"hydra.sweep.dir={sweep_dir}"], cwd=root)
    return root, sweep_dir, proc


def signal_when_held(
    args: list[str],
    cwd: Path | str,
    fault: str,
    ready: tuple[str, ...],
    signum: int,
    timeout: float = 500,
    env: dict[str, str] | None = None,
    to_group: bool = False,
) -> tuple[int, str]:
    """Run ``python train.py <args>`` through tests/faults.py with ``GPTLAB_TEST_FAULT=fault`` (a hook that
    prints a line and holds the run where the test wants it), and send ``signum`` once a line of the output
    starts with one of ``ready``: no timing is assumed. ``to_group``: to every process of the command (its
    own session), as a terminal's Ctrl-C or a scheduler's SIGTERM reaches them. Returns (exit status, the whole
    output)."""
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "faults.py"), *args],
        cwd=cwd,
        env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1", "GPTLAB_TEST_FAULT": fault},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=to_group,
    )
    lines: list[str] = []

    def watch() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(ready):
                if to_group:
                    os.killpg(proc.pid, signum)
                else:
                    proc.send_signal(signum)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    proc.wait(timeout=timeout)
    thread.join(timeout=30)
    return proc.returncode, "".join(lines)
