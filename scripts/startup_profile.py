"""Where the time from `python train.py` to the first training step goes, phase by phase, from whole processes.

    python scripts/startup_profile.py                                  # the default run, trainer.max_steps=1
    python scripts/startup_profile.py logger=csv --rounds 5
    python scripts/startup_profile.py task=word2vec --steps 20
    python scripts/startup_profile.py --against 4e03cf5                # ... and an older build, interleaved

Each round runs ``python train.py <overrides> trainer.max_steps=<--steps> hydra.run.dir=<a new folder>`` in the
checkout (so its token cache under ``outputs/cache`` is the one the user's runs share), as a whole process, with
a thin wrapper in front of ``train.py`` that notes the time at which the process reaches a few of gptlab's own
functions (the wrapper changes nothing the run does: it wraps them, and a torch optimizer-step hook notes the
first step). The phases are the spans between consecutive marks, from the moment the process is started to the
moment it has exited:

- *interpreter and imports*: Python starts, ``train.py`` imports Hydra and gptlab's entry point;
- *Hydra composes the config*: Hydra parses the command line and composes the config (the run directory
  chosen, its callbacks run), up to the task;
- *config parsed*: the typed config (``gptlab.config``; its imports, torch among them);
- *memory check, Lightning, run directory* (``task=gpt``): the memory estimate, Lightning's import, the run
  directory claimed and the seed set;
- *data ready*: the token cache opened (or made), the tokenizer, the windows;
- *model built*: the module and its weights;
- *loggers, trainer, W&B open*: the loggers, the Trainer, the model card and the config logged (which opens
  the W&B run);
- *first step*: Lightning's fit up to the end of the first optimizer step;
- *the other steps, validation, checkpoints*: the rest of Lightning's fit;
- *closing lines, result.json, W&B closed*: the task's report (for word2vec its evaluation too);
- *Hydra's job end*, *exit handlers* (W&B's, logging's) and *interpreter exit*: the process ends.

``task=word2vec`` has its own marks (config, corpus read, trainer made, fit; W&B opens in the background). A mark that a build does not reach
(an older commit without that function) is left out, and its span joins the next one. The rounds of the
builds (``--against REF``: that commit exported with ``git archive`` and run with its own ``src/``) are
interleaved, in an order that rotates each round, after an untimed run of each that fills the token and file
caches. Prints every process's marks, then per phase the median and range over the rounds, and with
``--against`` each build's median time to the first step and in all against the first build's, per round.
Timings on a shared machine vary by a third between runs: compare builds within one command.
"""

from __future__ import annotations

import argparse
import atexit
import importlib.abc
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MARKS_ENV = "GPTLAB_STARTUP_MARKS"

# ---- the marks: (label, module, attribute path, "enter" | "exit"), in the order a run reaches them ---------

GPT_MARKS = [
    ("Hydra starts", "hydra.main", "_run_hydra", "enter"),
    ("task starts", "gptlab.cli", "run_task", "enter"),
    ("config parsed", "gptlab.tasks.gpt", "parse_gpt", "exit"),
    ("run directory claimed", "gptlab.tasks.gpt", "build", "enter"),
    ("data ready", "gptlab.data.datamodule", "GPTDataModule.setup", "exit"),
    ("model built", "gptlab.tasks.gpt", "build", "exit"),
    ("loggers and W&B open", "gptlab.tasks.skeleton", "RunSession.save_config", "exit"),
    ("first step", "torch.optim.optimizer", "", "step"),
    ("fit done", "gptlab.tasks.gpt", "fit", "exit"),
    ("task returned", "gptlab.cli", "run_task", "exit"),
]
WORD2VEC_MARKS = [
    ("Hydra starts", "hydra.main", "_run_hydra", "enter"),
    ("task starts", "gptlab.cli", "run_task", "enter"),
    ("config parsed", "gptlab.tasks.word2vec", "Word2VecRunConfig.parse", "exit"),
    ("data ready", "gptlab.tasks.word2vec", "read_corpus", "exit"),
    ("trainer made", "gptlab.word2vec.task", "Trainer.__init__", "exit"),
    ("fit starts", "gptlab.word2vec.task", "Trainer.fit", "enter"),
    ("fit ends", "gptlab.word2vec.task", "Trainer.fit", "exit"),
    ("task returned", "gptlab.cli", "run_task", "exit"),
]
# the span that ends at each mark, as the report names it
PHASES = {
    "Hydra starts": "interpreter and imports",
    "task starts": "Hydra composes the config",
    "config parsed": "config parsed",
    "run directory claimed": "memory check, Lightning, run directory",
    "data ready": "data ready",
    "model built": "model built",
    "loggers and W&B open": "loggers, trainer, W&B open",
    "first step": "first step",
    "trainer made": "trainer made",
    "fit starts": "loggers, W&B open",
    "fit done": "the other steps, validation, checkpoints",
    "fit ends": "fit (every step)",
    "task returned": "closing lines, result.json, W&B closed",
    "exit handlers start": "Hydra's job end, threads joined",
    "exit handlers done": "exit handlers (atexit)",
    "exited": "interpreter exit",
}


def marks_for(overrides: list[str]) -> list[tuple[str, str, str, str]]:
    task = next((o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].lstrip("+") == "task"), "gpt")
    marks = WORD2VEC_MARKS if task == "word2vec" else GPT_MARKS
    return [*marks, *EXIT_MARKS]


# noted by the child itself: its first exit handler (registered when the task returns: they run last one
# first) and its last one (registered at its start)
EXIT_MARKS = [("exit handlers start", "", "", "atexit"), ("exit handlers done", "", "", "atexit")]


# ---- the child: train.py behind the wrapper -------------------------------------------------------------


class _MarkOnImport(importlib.abc.MetaPathFinder):
    """Wraps the marked functions of each module as it is imported (importing nothing early, so that each
    import's cost stays in the phase that pays it), and notes when each is first reached."""

    def __init__(self, marks: list[tuple[str, str, str, str]], out: Any) -> None:
        self.pending: dict[str, list[tuple[str, str, str]]] = {}
        for label, module, attr, when in marks:
            if when == "atexit":
                continue
            self.pending.setdefault(module, []).append((label, attr, when))
        self.out = out
        self.seen: set[str] = set()

    def note(self, label: str) -> None:
        if label not in self.seen:
            self.seen.add(label)
            self.out.write(
                json.dumps({"mark": label, "t": time.monotonic(), "cpu": time.process_time()}) + "\n"
            )
            self.out.flush()

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in self.pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run_module = loader.exec_module

        def exec_module(module: Any) -> None:
            run_module(module)
            for label, attr, when in self.pending.pop(name, []):
                self.wrap(module, label, attr, when)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec

    def wrap(self, module: Any, label: str, attr: str, when: str) -> None:
        if when == "step":  # torch's global hook after every optimizer step: the first one is the mark
            module.register_optimizer_step_post_hook(lambda *args, **kwargs: self.note(label))
            return
        *owners, name = attr.split(".")
        owner = module
        for part in owners:
            owner = getattr(owner, part, None)
        function = getattr(owner, name, None) if owner is not None else None
        if function is None:
            return  # not in this build: its span joins the next mark's

        def marked(*args: Any, **kwargs: Any) -> Any:
            if when == "enter":
                self.note(label)
            try:
                return function(*args, **kwargs)
            finally:
                if when == "exit":
                    self.note(label)
                if label == "task returned":
                    atexit.register(self.note, "exit handlers start")

        setattr(owner, name, marked)


def child(argv: list[str]) -> None:
    """``startup_profile.py --child train.py <overrides>``: run train.py as ``__main__`` with the marks on."""
    import runpy

    script, *rest = argv
    out = open(os.environ[MARKS_ENV], "a")  # noqa: SIM115 (open for the process's life)
    finder = _MarkOnImport(marks_for(rest), out)
    atexit.register(finder.note, "exit handlers done")
    sys.meta_path.insert(0, finder)
    sys.argv = [script, *rest]
    sys.path[0] = str(Path(script).resolve().parent)
    runpy.run_path(script, run_name="__main__")


# ---- the parent: rounds of whole processes --------------------------------------------------------------


@dataclass
class Build:
    """A checkout whose ``train.py`` is timed: this one, or an exported commit with its own ``src/``."""

    name: str
    root: Path
    env: dict[str, str] = field(default_factory=dict)

    def run(self, overrides: list[str], out: Path) -> dict[str, dict[str, float]]:
        """One whole process: each mark's wall seconds after the process was started (``wall``) and the
        process's CPU seconds by then (``cpu``, its threads together), ``exited`` last."""
        marks_file = out.with_suffix(".marks")
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(self.root / "src"), os.environ.get("PYTHONPATH")) if p
            ),
            "WANDB_MODE": os.environ.get("WANDB_MODE", "offline"),
            MARKS_ENV: str(marks_file),
            **self.env,
        }
        argv = [sys.executable, str(Path(__file__).resolve()), "--child", "train.py", *overrides]
        argv.append(f"hydra.run.dir={out}")
        log_file = out.with_suffix(".log")
        # into a file, not a pipe: the end is when the process exits, as a shell sees it, not when the last
        # process holding the pipe (W&B's service) closes it
        with open(log_file, "w") as log:
            t0 = time.monotonic()
            proc = subprocess.Popen(argv, cwd=self.root, env=env, stdout=log, stderr=subprocess.STDOUT)
            _, status, usage = os.wait4(proc.pid, 0)
            exited = time.monotonic() - t0
            returncode = os.waitstatus_to_exitcode(status)
            proc.returncode = returncode
        if returncode:
            raise SystemExit(
                f"{self.name}: `{shlex.join(argv)}` exited with {returncode}:\n{log_file.read_text()[-3000:]}"
            )
        log_file.unlink()
        marks = {}
        for line in marks_file.read_text().splitlines():
            item = json.loads(line)
            marks[item["mark"]] = {"wall": item["t"] - t0, "cpu": item["cpu"]}
        marks["exited"] = {"wall": exited, "cpu": usage.ru_utime + usage.ru_stime}
        shutil.rmtree(out, ignore_errors=True)
        marks_file.unlink()
        return marks


Marks = dict[str, dict[str, float]]  # mark -> {"wall": s after the start, "cpu": the process's CPU s by then}


def phases(marks: Marks, order: list[str], clock: str) -> dict[str, float]:
    """Each reached mark's span on ``clock`` (wall or cpu): the seconds since the mark reached before it (the
    process's start first)."""
    spans, before = {}, 0.0
    for label in order:
        if label in marks:
            spans[label] = marks[label][clock] - before
            before = marks[label][clock]
    return spans


def first_step_mark(order: list[str]) -> str:
    return "first step" if "first step" in order else "fit starts"


def _fmt(values: list[float]) -> str:
    if not values:
        return "-"
    median = statistics.median(values)
    return f"{median:.2f} ({min(values):.2f}-{max(values):.2f})" if len(values) > 1 else f"{median:.2f}"


def report(builds: list[str], results: dict[str, list[Marks]], order: list[str]) -> str:
    """A Markdown table: per phase, each build's wall and CPU seconds, median (range) over the rounds; then
    the time to the first step and the whole process; with several builds, each one's against the first's,
    round by round (ratios of the same round)."""
    step = first_step_mark(order)
    header = " | ".join(f"{name}: wall s | CPU s" for name in builds)
    lines = [f"| phase (ends at) | {header} |", "|---|" + "---:|---:|" * len(builds)]
    for label in order:
        cells = []
        for name in builds:
            for clock in ("wall", "cpu"):
                spans = [phases(m, order, clock).get(label) for m in results[name]]
                cells.append(_fmt([s for s in spans if s is not None]))
        if any(c != "-" for c in cells):
            lines.append(f"| {PHASES.get(label, label)} | " + " | ".join(cells) + " |")
    totals = (
        ("to the first step" if step == "first step" else "to the fit", step),
        ("whole process", "exited"),
    )
    for title, label in totals:
        cells = [
            _fmt([m[label][clock] for m in results[name] if label in m])
            for name in builds
            for clock in ("wall", "cpu")
        ]
        lines.append(f"| **{title}** | " + " | ".join(cells) + " |")
    first = builds[0]
    for name in builds[1:]:
        for title, label in totals:
            for clock in ("wall", "cpu"):
                ratios = [
                    a[label][clock] / b[label][clock]
                    for a, b in zip(results[first], results[name])
                    if label in a and label in b and b[label][clock] > 0
                ]
                if ratios:
                    lines.append(
                        f"{first} / {name}, {title}, {clock}: {statistics.median(ratios):.2f} "
                        f"({min(ratios):.2f}-{max(ratios):.2f}) over {len(ratios)} rounds"
                    )
    return "\n".join(lines)


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def export_build(ref: str, into: Path) -> Build:
    """The commit ``ref`` names, exported with ``git archive`` into a folder of ``into``, sharing this
    checkout's token cache (``GPTLAB_ROOT``), so that both builds open the same warm cache."""
    try:
        commit = git("rev-parse", "--short", f"{ref}^{{commit}}")
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"--against {ref}: not a commit of {ROOT}: {e.stderr.strip()}") from None
    folder = into / f"build-{commit}"
    folder.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", commit], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    return Build(f"gptlab {commit}", folder, {"GPTLAB_ROOT": str(ROOT)})


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        child(argv[1:])
        return 0
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (default 3)")
    parser.add_argument("--steps", type=int, default=1, help="trainer.max_steps of each run (default 1)")
    parser.add_argument("--against", action="append", default=[], metavar="REF", help="also time this commit")
    parser.add_argument("--no-warmup", action="store_true", help="no untimed run of each build first")
    args, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if o.startswith("-")]
    if bad:
        parser.error(f"unknown option(s) {bad}; Hydra overrides are written key=value")
    if any(o.split("=", 1)[0] in ("trainer.max_steps", "hydra.run.dir") for o in overrides):
        parser.error("trainer.max_steps and hydra.run.dir are set by the script (--steps)")
    overrides = [*overrides, f"trainer.max_steps={args.steps}"]
    order = [label for label, *_ in marks_for(overrides)] + ["exited"]
    here = git("rev-parse", "--short", "HEAD") + (
        " + changes" if git("status", "--porcelain", "-uno") else ""
    )
    with tempfile.TemporaryDirectory(prefix="gptlab-startup-") as tmp:
        builds = [Build(f"gptlab {here}", ROOT), *(export_build(ref, Path(tmp)) for ref in args.against)]
        load_before = os.getloadavg()[0]
        if not args.no_warmup:
            for build in builds:
                marks = build.run(overrides, Path(tmp) / f"warmup-{len(build.name)}")
                print(f"warm-up: {build.name}: {marks['exited']['wall']:.1f} s (not counted)", flush=True)
        results: dict[str, list[Marks]] = {b.name: [] for b in builds}
        for r in range(args.rounds):
            k = r % len(builds)
            for i, build in enumerate(builds[k:] + builds[:k]):
                marks = build.run(overrides, Path(tmp) / f"round{r}-{i}")
                results[build.name].append(marks)
                shown = ", ".join(f"{label} {marks[label]['wall']:.2f}" for label in order if label in marks)
                print(f"round {r + 1}/{args.rounds}: {build.name}: {shown}", flush=True)
        load_after = os.getloadavg()[0]
    print(json.dumps({"overrides": overrides, "results": results, "load_average": [load_before, load_after]}))
    command = shlex.join(["python", "scripts/startup_profile.py", *argv])
    print()
    print(report([b.name for b in builds], results, order))
    print(
        f"\n{args.rounds} interleaved rounds, seconds after the process was started; {os.cpu_count()} cores; "
        f"load average {load_before:.1f} before, {load_after:.1f} after. Command: `{command}`"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
