"""Run the shell and Python blocks of the documentation, as a reader would type them, in one process.

`tests/test_docs.py` starts this file once (`python tests/docs_runner.py plan.json result.json`) and checks
what it records. The plan names, page by page, a working directory (the project's `train.py`, `conf/`,
`scripts/` and `src/` linked into it, its own `outputs/`) and the blocks to run there, in page order, so that
a later block finds the runs an earlier block of the same page made.

A block is cut into commands as bash would cut it: `\\` continues a line, `#` starts a comment, `&&` and `;`
separate commands, a heredoc (`<<'EOF'`) belongs to its line. Bash itself expands each command (quotes,
variables, globs), and then:

- `python train.py ...`, `python scripts/<name>.py ...` and `python -m <module> ...` run in this process
  (`runpy`, with the command's argv and environment), so that the interpreter and Lightning start once
  rather than once per command; the plan's `train_overrides` (a tiny model, a few steps) are added to every
  `train.py` command that does not set the same key itself (nor, in a block that expects a refusal, the
  model's keys where the command names a model: `model=gpt3` refused as too large is refused as typed), and
  `script_args` to the named scripts;
- `cd`, `export` change the directory and environment of the following commands of the page;
- anything else, and any line with a pipe, a redirection or `&`, runs in `bash -c`.

`outputs/runs/<date>/<time>` and `outputs/multirun/<date>/<time>` in a command stand for the newest run or
sweep directory of the page. A Python block runs with `exec`. Each command's exit status and everything it
printed (file descriptors 1 and 2, so that C-level and subprocess output is kept too) go to the result file.
"""

from __future__ import annotations

import json
import os
import re
import resource
import runpy
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

PLACEHOLDERS = {
    "outputs/runs/<date>/<time>": ("outputs/runs", 2),
    "outputs/multirun/<date>/<time>": ("outputs/multirun", 2),
}


# ---- cutting a block into commands ---------------------------------------------------------------------


def logical_lines(text: str) -> list[str]:
    """Lines joined at a trailing backslash; a heredoc kept with the line that opens it."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        while line.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line.rstrip()[:-1] + " " + lines[i].strip()
        heredoc = re.search(r"<<-?\s*(['\"]?)(\w+)\1", line)
        if heredoc:
            body = [line]
            i += 1
            while i < len(lines) and lines[i].strip() != heredoc.group(2):
                body.append(lines[i])
                i += 1
            body.append(heredoc.group(2))
            line = "\n".join(body)
        if line.strip() and not line.lstrip().startswith("#"):
            out.append(line)
        i += 1
    return out


def split_commands(line: str) -> tuple[list[str], bool]:
    """Cut a logical line at `&&` and `;` outside quotes, dropping a trailing comment. The flag says whether
    the line needs a real shell (a pipe, a redirection, `&`, `||`, a subshell or a heredoc)."""
    if "\n" in line:
        return [line], True
    parts: list[str] = []
    current: list[str] = []
    quote = ""
    needs_shell = False
    i = 0
    while i < len(line):
        c = line[i]
        if quote:
            if c == quote:
                quote = ""
            elif c == "\\" and quote == '"' and i + 1 < len(line):
                current.append(c)
                i += 1
                c = line[i]
            current.append(c)
        elif c in "'\"":
            quote = c
            current.append(c)
        elif c == "\\" and i + 1 < len(line):
            current.append(line[i : i + 2])
            i += 1
        elif c == "#" and (not current or current[-1] in " \t"):
            break
        elif line.startswith("&&", i) or c == ";":
            parts.append("".join(current).strip())
            current = []
            i += 1 if c == ";" else 2
            continue
        elif c == "<" and re.match(r"<[A-Za-z][\w -]*>", line[i:]):  # a placeholder, <date>/<time>
            end = line.index(">", i)
            current.append(line[i : end + 1])
            i = end + 1
            continue
        elif c in "|<>&()`":
            needs_shell = True
            current.append(c)
        elif c == "$" and line.startswith("$(", i):
            needs_shell = True
            current.append(c)
        else:
            current.append(c)
        i += 1
    parts.append("".join(current).strip())
    parts = [p for p in parts if p]
    if needs_shell:
        return [line], True
    return parts, False


def expand(command: str, cwd: Path, env: dict[str, str]) -> list[str]:
    """The argv bash makes of ``command`` (quotes removed, variables and globs expanded)."""
    proc = subprocess.run(
        ["bash", "-c", f'set -- {command}\nprintf "%s\\0" "$@"'],
        cwd=cwd,
        env=env,
        capture_output=True,
        check=True,
    )
    return proc.stdout.decode().split("\0")[:-1]


def fill_placeholders(command: str, cwd: Path) -> str:
    for placeholder, (root, depth) in PLACEHOLDERS.items():
        if placeholder in command:
            pattern = "/".join(["*"] * depth)
            found = sorted(
                (p for p in (cwd / root).glob(pattern) if p.is_dir()), key=lambda p: p.stat().st_mtime
            )
            if found:
                command = command.replace(placeholder, str(found[-1].relative_to(cwd)))
    return command


# ---- running ----------------------------------------------------------------------------------------


#: attention presets that set a window, shortened by :func:`with_test_arguments` to fit the plan's context
WINDOWED_PRESETS = ("attention=sliding_window", "attention=gemma2")


def key_of(arg: str) -> str | None:
    if arg.startswith("-") or "=" not in arg:
        return None
    return arg.split("=", 1)[0].lstrip("+~")


def with_test_arguments(argv: list[str], plan: dict, refusal: bool = False) -> list[str]:
    """``argv`` (``[script, *args]``) with the plan's additions that the command does not set itself;
    ``refusal``: the command is expected to be refused, and a model it names is kept as typed."""
    script = argv[0]
    if Path(script).name == "train.py":
        if any(a in ("--help", "-h", "--cfg", "--info", "--hydra-help") for a in argv[1:]):
            return argv
        keys = {key_of(a) for a in argv[1:]}
        as_typed = {"model"} if refusal and "model" in keys else set()
        extra = [
            o
            for o in plan["train_overrides"]
            if key_of(o) not in keys and key_of(o).split(".")[0] not in as_typed
        ]
        if any(a in WINDOWED_PRESETS for a in argv[1:]) and "attention.window" not in keys:
            # the presets' window (64) is sized for the default 128 positions; the plan's context is shorter,
            # and a window no shorter than the context is refused
            extra.append("attention.window=16")
        return [*argv, *extra]
    extra_args = plan["script_args"].get(script.removeprefix("./"))
    if extra_args and not any(a in ("--help", "-h") for a in argv[1:]):
        keys = {key_of(a) for a in argv[1:]}
        added: list[str] = []
        for item in extra_args:  # "--flag value" (appended: argparse keeps the last) or "key=value"
            if key_of(item) is not None and key_of(item) in keys:
                continue
            added.extend(item.split())
        return [*argv, *added]
    return argv


class Captured:
    """Send file descriptors 1 and 2 to a temporary file while a command runs in this process."""

    def __enter__(self) -> Captured:
        sys.stdout.flush()
        sys.stderr.flush()
        self.file = tempfile.TemporaryFile()
        self.saved = (os.dup(1), os.dup(2))
        os.dup2(self.file.fileno(), 1)
        os.dup2(self.file.fileno(), 2)
        return self

    def __exit__(self, *exc) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(self.saved[0], 1)
        os.dup2(self.saved[1], 2)
        for fd in self.saved:
            os.close(fd)
        self.file.seek(0)
        self.text = self.file.read().decode(errors="replace")
        self.file.close()


def exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def status_of(run: Callable[[], object]) -> int:
    """The exit status a process running ``run`` would end with: 0, its ``sys.exit`` code, or 1 with the
    traceback printed."""
    try:
        run()
        return 0
    except SystemExit as e:
        return exit_status(e.code)
    except BaseException:
        traceback.print_exc()
        return 1


def run_in_process(argv: list[str], cwd: Path, env: dict[str, str], module: bool) -> int:
    from hydra.core.global_hydra import GlobalHydra

    saved_argv, saved_path, saved_env = sys.argv[:], sys.path[:], dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = list(argv)
    if not module:  # the script's folder, as python puts it first on sys.path: the page's, and the project's
        sys.path[:0] = [str(Path(argv[0]).absolute().parent), str(Path(argv[0]).resolve().parent)]
    try:
        if module:
            return status_of(lambda: runpy.run_module(argv[0], run_name="__main__", alter_sys=True))
        return status_of(lambda: runpy.run_path(argv[0], run_name="__main__"))
    finally:
        GlobalHydra.instance().clear()
        if "torch.distributed" in sys.modules:  # a strategy's process group ends with its command
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
        sys.argv, sys.path[:] = saved_argv, saved_path
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(cwd)


def run_python_block(text: str, name: str, cwd: Path, env: dict[str, str]) -> int:
    saved_env = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    try:
        return status_of(lambda: exec(compile(text, name, "exec"), {"__name__": "__main__"}))
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(cwd)


def run_command(command: str, state: dict, plan: dict) -> dict:
    cwd, env = state["cwd"], state["env"]
    command = fill_placeholders(command, cwd)
    record: dict = {"command": command}
    start = time.perf_counter()
    argv = expand(command, cwd, env)
    assignments = {}
    while argv and re.fullmatch(r"[A-Za-z_]\w*=.*", argv[0]):
        name, value = argv.pop(0).split("=", 1)
        assignments[name] = value
    if argv and argv[0] == "cd":
        state["cwd"] = (cwd / (argv[1] if len(argv) > 1 else ".")).resolve()
        record.update(exit=0, output="")
    elif argv and argv[0] == "export":
        for item in argv[1:]:
            name, _, value = item.partition("=")
            env[name] = value
        record.update(exit=0, output="")
    elif (
        argv
        and argv[0] in ("python", "python3")
        and len(argv) > 1
        and (argv[1].endswith(".py") or argv[1] == "-m")
    ):
        module = argv[1] == "-m"
        target = argv[2:] if module else argv[1:]
        if not module:
            target = with_test_arguments(target, plan, refusal=state.get("refusal", False))
        record["argv"] = ["python", *(["-m"] if module else []), *target]
        with Captured() as out:
            code = run_in_process(target, cwd, {**env, **assignments}, module)
        record.update(exit=code, output=out.text)
    else:
        with Captured() as out:
            proc = subprocess.run(["bash", "-c", command], cwd=cwd, env=env)
        record.update(exit=proc.returncode, output=out.text)
    record["seconds"] = round(time.perf_counter() - start, 2)
    return record


def cpu_seconds() -> float:
    """CPU time of this process and of the children it waited for, so far."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def run_block(block: dict, state: dict, plan: dict) -> list[dict]:
    if block["kind"] == "python":
        start = time.perf_counter()
        with Captured() as out:
            code = run_python_block(block["text"], f"<{block['id']}>", state["cwd"], state["env"])
        return [
            {
                "command": "<python block>",
                "exit": code,
                "output": out.text,
                "seconds": round(time.perf_counter() - start, 2),
            }
        ]
    records = []
    state["refusal"] = block.get("expect_exit") not in (None, 0)
    for line in logical_lines(block["text"]):
        commands, whole_line = split_commands(fill_placeholders(line, state["cwd"]))
        for command in commands:
            if whole_line:
                start = time.perf_counter()
                with Captured() as out:
                    proc = subprocess.run(["bash", "-c", command], cwd=state["cwd"], env=state["env"])
                record = {
                    "command": command,
                    "exit": proc.returncode,
                    "output": out.text,
                    "seconds": round(time.perf_counter() - start, 2),
                }
            else:
                record = run_command(command, state, plan)
            records.append(record)
            if record["exit"] != 0 and block.get("expect_exit") is None:
                return records
    return records


def main(plan_path: str, result_path: str) -> None:
    plan = json.loads(Path(plan_path).read_text())
    sys.path.insert(0, plan["pythonpath"])
    results: dict[str, list[dict]] = {}
    for page in plan["pages"]:
        page_dir = Path(page["dir"])
        env = {**os.environ, **plan["env"]}
        state = {"cwd": page_dir, "env": env}
        for block in page["blocks"]:
            start, cpu = time.perf_counter(), cpu_seconds()
            results[block["id"]] = run_block(block, state, plan)
            print(
                f"{block['id']}: {time.perf_counter() - start:.1f} s, {cpu_seconds() - cpu:.1f} s of CPU",
                file=sys.stderr,
                flush=True,
            )
            Path(result_path).write_text(json.dumps(results))
    Path(result_path).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
