"""The README and the pages under docs/ say only what the code does.

Conventions the pages follow, and what is checked:

- A fenced `bash` (or `sh`, `shell`, `console`) block runs here, at tiny scale: `tests/docs_runner.py` runs
  the blocks of each page in order, in a folder of its own, adding the overrides of ``TRAIN_OVERRIDES`` to
  every `python train.py` command (a tiny model, four steps, the character vocabulary, CSV metrics) unless the
  command sets that key itself, and ``SCRIPT_ARGS`` to the scripts named there. Every command must exit with
  status 0.
- A block that cannot run here says so, and why, on the line right before it:
  `<!-- not-run: needs a GPU -->`. Its `python train.py` commands are still composed (each option and choice
  must exist; a sweep's first value stands for the sweep), and the scripts and flags it names must exist.
  An unmarked block is a block that runs: there is no third kind.
- `<!-- exit: 2 -->` before a block: its last command must exit with that status (a refusal).
- A `text` block right after a command block is what the commands print: each of its lines must match a line
  of their output, in order. Numbers stand for any number (a tiny run prints other figures), `...` for any
  text, `<a placeholder>` for any text, and `above`/`below` for either.
- A `python` or `yaml` block whose first line is a comment naming a path (`# conf/pos/kerple.yaml`) is a file
  the page asks the reader to write: it is written into the project copy the blocks run in, before they run.
  Any other `python` block runs (in the page's folder), unless marked `not-run`.
- In the prose, a code span that names a file of the project (`conf/...`, `src/...`, `scripts/...`), a
  Python object (`gptlab.runs.trained.load_run`), a config option (`optim.muon_lr`) or a config choice
  (`pos=rope`) must name one that exists.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import warnings
from functools import cache
from pathlib import Path

import pytest
import yaml
from conftest import CONF, ROOT
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser

pytestmark = pytest.mark.docs

DOCS = ROOT / "docs"
# The pages (not the tables scripts write into docs/<study>/, which are records of what they printed).
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md")), *sorted((DOCS / "reference").glob("*.md"))]
SHELL = {"bash", "sh", "shell", "console"}
FILE_BLOCK = re.compile(r"^#\s*((?:\w[\w-]*/)*\w[\w-]*\.(?:py|yaml))\s*$")
MARKER = re.compile(r"^<!--\s*(not-run|exit):\s*(.*?)\s*-->$")
MARKER_LIKE = re.compile(r"^<!--\s*(not[- _]?run|skip|no[- _]?run|exit|run)\b", re.IGNORECASE)

# Added to every `python train.py` command of a block that runs, unless the command sets the key.
TRAIN_OVERRIDES = [
    "model.n_layer=2",  # 2: the card says "2 layers", as the pages show it (1 reads "1 layer")
    "model.n_head=2",
    "model.n_embd=32",
    "model.block_size=32",
    "data.batch_size=4",
    "tokenizer=char",
    "trainer.max_steps=2",
    "optim.warmup_steps=1",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=1",
    "callbacks.sample_generation.max_new_tokens=2",
    "logger=csv",
    "eval_length.max_tokens=2048",
    "eval_length.passkey.depths=1",
    "eval_length.passkey.trials=1",
]
# Added to the scripts a block runs, unless the command gives the flag or key itself.
# Their flags come last, so that they win over the command's own (argparse keeps the last value).
SCRIPT_ARGS = {
    "scripts/eval_length.py": ["--max-tokens 2048", "--passkey-depths 1", "--passkey-trials 1", "--no-wandb"],
    "scripts/evaluate.py": ["--no-wandb"],
    "scripts/benchmark.py": ["--rounds 1", "--steps 1", "--warmup 0", "--rows 256", *TRAIN_OVERRIDES[:6]],
    "scripts/coord_check.py": ["--widths 16,32", "--steps 1"],
}
# The runner's environment: no GPU (the pages' refusals are those of a CPU machine), nothing online.
RUN_ENV = {
    "CUDA_VISIBLE_DEVICES": "",
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "OMP_NUM_THREADS": "1",  # two runners side by side, one core each
    "PYTHONUNBUFFERED": "1",
}


@dataclasses.dataclass
class Block:
    page: str
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    not_run: str | None = None  # the reason
    exit: int | None = None
    output: Block | None = None  # the `text` block that follows
    file: str | None = None  # a file block's path

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.not_run is None and self.file is None and self.lang in SHELL | {"python"}


def page_name(path: Path) -> str:
    return str(path.relative_to(ROOT))


@cache
def parse(path: Path) -> tuple[Block, ...]:
    """The fenced blocks of a page, with their markers and the output blocks attached to commands."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    last_command: Block | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        if re.match(r"^#{1,6} ", line):
            last_command = None
        fence = re.match(r"^(\s*)(```+|~~~+)\s*([\w+-]*)", line)
        if not fence:
            i += 1
            continue
        indent, ticks, lang = fence.group(1), fence.group(2), fence.group(3).lower()
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(ticks):
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        start = i - len(body)
        block = Block(page_name(path), start, lang, "\n".join(body) + "\n")
        j = start - 2  # the line before the fence
        while j >= 0 and not lines[j].strip():
            j -= 1
        while j >= 0 and lines[j].strip().startswith("<!--"):
            marker = MARKER.match(lines[j].strip())
            if marker and marker.group(1) == "not-run":
                block.not_run = marker.group(2)
            elif marker:
                block.exit = int(marker.group(2))
            elif MARKER_LIKE.match(lines[j].strip()):
                raise AssertionError(
                    f"{block.id}: {lines[j].strip()!r} is not a marker this test knows: write "
                    "<!-- not-run: <why> --> or <!-- exit: <status> -->"
                )
            j -= 1
        if lang in ("python", "yaml") and body and FILE_BLOCK.match(body[0]):
            block.file = FILE_BLOCK.match(body[0]).group(1)
        if lang == "text":
            assert last_command is not None, (
                f"{block.id}: a `text` block is what a command prints, but no command block comes before "
                "it in this section"
            )
            assert last_command.output is None, f"{block.id}: a second output block for {last_command.id}"
            last_command.output = block
            last_command = None
        elif lang in SHELL or (lang == "python" and block.file is None):
            last_command = block
        blocks.append(block)
        i += 1
    return tuple(blocks)


def all_blocks() -> list[Block]:
    return [b for page in PAGES for b in parse(page)]


@cache
def file_block_paths() -> frozenset[str]:
    return frozenset(b.file for b in all_blocks() if b.file)


# ---- the blocks themselves ------------------------------------------------------------------------------


def test_every_command_block_runs_or_says_why_not():
    for block in all_blocks():
        if block.lang in SHELL and block.not_run is not None:
            assert len(block.not_run) > 5, f"{block.id}: say why it cannot run here"
        if block.exit is not None:
            assert block.runs, f"{block.id}: an exit status for a block that does not run"
    assert any(b.runs for b in all_blocks())


def test_file_blocks_name_new_files():
    """A file the pages ask to write is new: the pages never show an edited copy of a file that exists."""
    for block in all_blocks():
        if block.file:
            assert not (ROOT / block.file).exists(), (
                f"{block.id}: {block.file} exists; a page's file block must be a new file"
            )


# ---- running them ---------------------------------------------------------------------------------------


def drop_file_permission_bypass() -> None:
    """As root, a process reads any file: drop the two capabilities that allow it from the bounding set, so
    that the pages' commands meet file permissions as a user's do (tests/test_errors.py does the same)."""
    if os.geteuid() != 0:
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP; without CAP_SETPCAP it fails, and root stays root


@cache
def file_permissions_apply() -> bool:
    """Whether a child started with ``drop_file_permission_bypass`` is refused a file it may not read (as
    root without CAP_SETPCAP it is not, and the pages' permission refusals cannot happen)."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        probe = Path(folder) / "probe"
        probe.write_text("x")
        probe.chmod(0)
        proc = subprocess.run(
            ["cat", str(probe)], capture_output=True, preexec_fn=drop_file_permission_bypass
        )
    return proc.returncode != 0


def needs_file_permissions(block: Block) -> bool:
    return bool(re.search(r"\bchmod\b", block.text))


def project_copy(into: Path) -> Path:
    """The project the blocks run against: train.py, conf/, scripts/, src/ and pyproject.toml, copied, with
    the pages' file blocks written in."""
    project = into / "project"
    project.mkdir()
    for name in ("conf", "scripts", "src"):
        shutil.copytree(
            ROOT / name, project / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
        )
    for name in ("train.py", "pyproject.toml"):
        shutil.copy(ROOT / name, project / name)
    for block in all_blocks():
        if block.file and in_project(block.file):
            write_file_block(block, project)
    return project


def in_project(path: str) -> bool:
    """A file block for the project itself (src/, conf/, scripts/); any other (a module of the reader's own,
    a config folder of theirs) goes into the folder its page's commands run in."""
    return Path(path).parts[0] in ("src", "conf", "scripts")


def write_file_block(block: Block, root: Path) -> None:
    target = root / block.file
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(block.text)


RUNNERS = 2  # processes running the pages side by side, one per core of a 2-core machine


def page_weight(page: dict) -> int:
    """About how long a page takes: its Python commands (each composes a config, most train a tiny run)."""
    return sum(len(re.findall(r"^\s*(?:\w+=\S+\s+)*python3? ", b["text"], re.M)) or 1 for b in page["blocks"])


@pytest.fixture(scope="session")
def runners(request, tmp_path_factory):
    """The runners, started before the first test of the session that needs them, so that they work while
    the checks that run nothing do theirs. Only the pages whose test was selected run (`pytest
    tests/test_docs.py -k bad-input` runs one page)."""
    selected = {
        item.callspec.params["page"]
        for item in request.session.items
        if getattr(item, "originalname", "") == "test_the_commands_of_a_page_run_and_print_what_it_says"
    }
    if not selected:
        yield None
        return
    tmp = tmp_path_factory.mktemp("docs")
    project = project_copy(tmp)
    pages = []
    for path in PAGES:
        blocks = [b for b in parse(path) if b.runs]
        if not blocks or page_name(path) not in selected:
            continue
        page_dir = tmp / "pages" / page_name(path).replace("/", "_")
        page_dir.mkdir(parents=True)
        for name in ("train.py", "conf", "scripts", "src", "pyproject.toml"):
            (page_dir / name).symlink_to(project / name)
        for block in parse(path):
            if block.file and not in_project(block.file):
                write_file_block(block, page_dir)
        pages.append(
            {
                "page": page_name(path),
                "dir": str(page_dir),
                "blocks": [
                    {"id": b.id, "kind": "python" if b.lang == "python" else "shell", "text": b.text}
                    | ({"expect_exit": b.exit} if b.exit is not None else {})
                    for b in blocks
                ],
            }
        )
    groups: list[list[dict]] = [[] for _ in range(RUNNERS)]
    for page in sorted(pages, key=page_weight, reverse=True):  # the heaviest first, to the lightest group
        min(groups, key=lambda g: sum(map(page_weight, g))).append(page)
    env = {
        **os.environ,
        **RUN_ENV,
        "PYTHONPATH": str(project / "src"),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    started = []
    for k, group in enumerate(g for g in groups if g):
        plan = {
            "pages": group,
            "pythonpath": str(project / "src"),
            "env": {**RUN_ENV, "PYTHONPATH": str(project / "src"), "GPTLAB_ROOT": "."},
            "train_overrides": TRAIN_OVERRIDES,
            "script_args": SCRIPT_ARGS,
        }
        plan_file, result_file, log = tmp / f"plan{k}.json", tmp / f"result{k}.json", tmp / f"timings{k}.txt"
        plan_file.write_text(json.dumps(plan, indent=1))
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "docs_runner.py"), str(plan_file), str(result_file)],
            env=env,
            cwd=tmp,
            stdout=subprocess.DEVNULL,
            stderr=log.open("w"),  # per block: wall and CPU seconds
            preexec_fn=drop_file_permission_bypass,
        )
        started.append((proc, result_file, log))
    yield started
    for proc, _, _ in started:
        if proc.poll() is None:
            proc.kill()


@pytest.fixture(autouse=True)
def _start_runners_early(runners):
    """Every test of this file asks for the runners, so that they start with the first one."""


@pytest.fixture(scope="session")
def doc_runs(runners) -> dict[str, list[dict]]:
    """Every block that runs, run once: {block id: [{command, argv, exit, output, seconds}, ...]}."""
    results: dict[str, list[dict]] = {}
    for proc, result_file, log in runners or []:
        # a bound against a runner that hangs, not a duration: the pages' commands run side by side with the
        # rest of the suite, and a loaded machine takes several times as long as an idle one
        proc.wait(timeout=3600)
        if not result_file.exists():
            raise AssertionError(f"a runner failed ({proc.returncode}):\n{log.read_text()[-6000:]}")
        results |= json.loads(result_file.read_text())
    return results


NUMBER = r"[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?[kMGT]?"


def line_pattern(expected: str) -> re.Pattern:
    """A printed line as a pattern: numbers, `...`, `<placeholders>` and above/below vary."""
    token = re.compile(rf"(\s*\.\.\.\s*|<[a-z][a-z ]*>|\babove\b|\bbelow\b|{NUMBER}|\s+)")
    parts = []
    for piece in token.split(expected.strip()):
        if not piece:
            continue
        if piece.strip() == "...":
            parts.append(".*?")
        elif re.fullmatch(r"<[a-z][a-z ]*>", piece):
            parts.append(".+?")
        elif piece in ("above", "below"):
            parts.append("(?:above|below)")
        elif re.fullmatch(NUMBER, piece):
            parts.append(NUMBER)
        elif piece.isspace():
            parts.append(r"\s+")
        else:
            parts.append(re.escape(piece))
    return re.compile("".join(parts))


def check_output(expected: str, printed: str) -> list[str]:
    """The expected lines not found, in order, among the printed ones."""
    printed_lines = [ln for ln in re.split(r"[\r\n]+", printed) if ln.strip()]
    missing = []
    position = 0
    for line in expected.splitlines():
        if not line.strip():
            continue
        pattern = line_pattern(line)
        for k in range(position, len(printed_lines)):
            if pattern.search(printed_lines[k]):
                position = k + 1
                break
        else:
            missing.append(line)
    return missing


def pages_that_run() -> list[str]:
    return [page_name(p) for p in PAGES if any(b.runs for b in parse(p))]


# ---- what does not run is still checked ----------------------------------------------------------------


def commands_of(block: Block) -> list[list[str]]:
    """The simple commands of a shell block, split as the shell would (without expanding anything)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from docs_runner import logical_lines, split_commands

    out = []
    for line in logical_lines(block.text):
        commands, whole = split_commands(line)
        for command in commands:
            if whole:
                out.append(["bash", "-c", command])
            else:
                out.append(shlex.split(command, comments=True))
    return out


def train_arguments(argv: list[str]) -> list[str] | None:
    """The train.py arguments of a command (`python train.py ...`, `torchrun ... train.py ...`, `srun ...`)."""
    while argv and re.fullmatch(r"[A-Za-z_]\w*=.*", argv[0]):
        argv = argv[1:]
    for k, arg in enumerate(argv):
        if arg == "train.py" or arg.endswith("/train.py"):
            return argv[k + 1 :]
    return None


HYDRA_FLAGS_WITH_VALUE = {
    "--cfg",
    "-c",
    "--package",
    "-p",
    "--info",
    "-i",
    "--config-path",
    "-cp",
    "--config-name",
    "-cn",
    "--config-dir",
    "-cd",
}


def hydra_overrides(args: list[str]) -> list[str]:
    """The overrides of a train.py command line, without Hydra's flags and their values."""
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in HYDRA_FLAGS_WITH_VALUE:
            skip = True
        elif not arg.startswith("-"):
            out.append(arg)
    return out


def first_of_each_sweep(overrides: list[str]) -> list[str]:
    out = []
    for override in OverridesParser.create().parse_overrides(overrides):
        if not override.is_sweep_override():
            out.append(override.input_line)
            continue
        try:
            first = next(iter(override.sweep_string_iterator()))
        except Exception:  # glob(*), interval(...): what the sweeper draws from
            continue
        out.append(f"{override.get_key_element()}={first}")
    return out


def compose_overrides(overrides: list[str]) -> None:
    if not GlobalHydra.instance().is_initialized():
        initialize_config_dir(str(CONF), version_base="1.3")
    compose("train", overrides=overrides, return_hydra_config=True)


@pytest.mark.parametrize("page", [page_name(p) for p in PAGES])
def test_every_command_names_options_scripts_and_flags_that_exist(page):
    from gptlab.runs.resume import register_resolvers

    register_resolvers()
    GlobalHydra.instance().clear()
    try:
        check_commands(page)
    finally:
        GlobalHydra.instance().clear()


def check_commands(page: str) -> None:
    for block in parse(ROOT / page):
        if block.lang not in SHELL:
            continue
        for argv in commands_of(block):
            problem = command_problem(
                argv, refusal=block.exit is not None
            )  # a refusal is checked by running it
            assert problem is None, f"{block.id}: `{shlex.join(argv)}` {problem}"


def command_problem(argv: list[str], refusal: bool = False) -> str | None:
    """Why a command names an option, a choice, a script, a flag or an extra that does not exist (None when
    it names none). A ``refusal`` (a block with an exit status) names what does not exist on purpose: its
    options and flags are checked by running it."""
    args = train_arguments(argv)
    if args is not None and not refusal:
        try:
            overrides = first_of_each_sweep([a for a in hydra_overrides(args) if not re.search("[<>]", a)])
            uses_new = any(tuple(o.split("=", 1)) in new_choices() for o in overrides if "=" in o)
            if not uses_new and not any(o.startswith("plugins=") for o in overrides):
                compose_overrides(overrides)
        except Exception as e:
            return f"does not compose: {e}"
    for k, arg in enumerate(argv):
        if re.fullmatch(r"(\./)?scripts/\w+\.py", arg):
            script = ROOT / arg
            if not script.exists():
                return f"names {arg}, which does not exist"
            source = script.read_text()
            for flag in argv[k + 1 :]:
                name = flag.split("=", 1)[0]
                if re.fullmatch(r"--[\w-]+", name) and f'"{name}"' not in source and not refusal:
                    return f"gives {arg} an option it does not have: {name}"
            break
    if argv[:2] == ["pip", "install"]:
        for extra in re.findall(r"\.\[([\w,-]+)\]", " ".join(argv)):
            for name in extra.split(","):
                if f"\n{name} = [" not in (ROOT / "pyproject.toml").read_text():
                    return f"installs an extra pyproject.toml does not have: {name!r}"
    return None


# ---- the prose ---------------------------------------------------------------------------------------


def prose_spans(path: Path) -> list[tuple[int, str]]:
    """The inline code spans of a page outside its fenced blocks (a span may wrap onto the next line), with
    the line each starts on."""
    lines = path.read_text().splitlines()
    prose = []
    in_fence = False
    for line in lines:
        if re.match(r"^\s*(```|~~~)", line):
            in_fence = not in_fence
            prose.append("")
        else:
            prose.append("" if in_fence else line)
    text = "\n".join(prose)
    spans = []
    for match in re.finditer(r"(?<!`)`([^`]+?)`(?!`)", text):
        if "\n\n" not in match.group(1):
            spans.append((text.count("\n", 0, match.start()) + 1, " ".join(match.group(1).split())))
    return spans


@cache
def config_keys() -> frozenset[str]:
    """Every dotted key the config files define (`optim.muon_lr`, `logger.wandb.project`, ...)."""
    keys: set[str] = set()

    def walk(node, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "defaults":
                    continue
                name = f"{prefix}.{key}" if prefix else str(key)
                keys.add(name)
                walk(value, name)

    for file in CONF.rglob("*.yaml"):
        group = file.parent.relative_to(CONF)
        text = file.read_text()
        node = yaml.safe_load(text) or {}
        if file == CONF / "train.yaml" or "@package _global_" in text:
            prefix = ""
        elif str(group).startswith("hydra"):
            prefix = str(group).replace("/", ".")
        else:
            prefix = str(group).replace("/", ".")
        walk(node, prefix)
    return frozenset(keys)


@cache
def config_groups() -> dict[str, set[str]]:
    groups = {}
    for folder in sorted(p for p in CONF.rglob("*") if p.is_dir()):
        choices = {f.stem for f in folder.glob("*.yaml")}
        if choices:
            groups[str(folder.relative_to(CONF))] = choices
    for path in new_choices():
        groups.setdefault(path[0], set()).add(path[1])
    return groups


@cache
def new_choices() -> frozenset[tuple[str, str]]:
    """(group, choice) of the YAMLs the pages' file blocks write (`conf/pos/x.yaml`, `my_conf/pos/x.yaml`)."""
    out = set()
    for path in file_block_paths():
        parts = Path(path).parts
        if path.endswith(".yaml") and len(parts) >= 3:
            out.add(("/".join(parts[1:-1]), Path(path).stem))
    return frozenset(out)


def trainer_arguments() -> set[str]:
    import lightning

    return set(inspect.signature(lightning.Trainer.__init__).parameters)


def resolve_python_name(name: str) -> bool:
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except ImportError:
            continue
        try:
            for attr in parts[k:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def reference_problem(span: str) -> str | None:
    """Why a code span of the prose names something that does not exist (None when it does, or when it is
    not a reference this test knows how to check)."""
    file_blocks = file_block_paths()
    text = span.rstrip(".,:;")
    if re.search(
        r"\.(safetensors|json|jsonl|yaml|yml|py|bin|pt|ckpt|md|png|txt|csv|parquet|log|toml|distcp)$", text
    ) and not re.fullmatch(r"(src|conf|scripts|tests|docs|\.ci)/.*", text):
        return None  # a file name (config.json, model.safetensors), not an option
    path_like = re.fullmatch(r"(src|conf|scripts|tests|docs|\.ci)/[\w./*<>-]*|[\w-]+\.(py|toml|yml)", text)
    if path_like and " " not in text:
        if text in file_blocks:
            return None
        if re.fullmatch(r"[\w-]+\.(py|toml|yml)", text):  # a bare file name: checked when it is at the root
            at_root = text in ("train.py", "pyproject.toml", "mkdocs.yml")
            return f"{text} does not exist" if at_root and not (ROOT / text).exists() else None
        pattern = re.sub(r"<[^>]*>", "*", text)
        if any(ch in pattern for ch in "*?["):
            return None if list(ROOT.glob(pattern)) else f"nothing matches {text}"
        return None if (ROOT / text).exists() else f"{text} does not exist"
    python = re.fullmatch(r"(gptlab(?:\.\w+)+)(\(.*\))?", text)
    if python:
        return None if resolve_python_name(python.group(1)) else f"{python.group(1)} cannot be imported"
    groups = config_groups()
    choice = re.fullmatch(r"\+?([\w/]+)=([\w.-]+)", text)
    if choice and choice.group(1) in groups:
        if choice.group(2) in groups[choice.group(1)] or choice.group(2) == "null":
            return None
        return f"{choice.group(1)} has no choice {choice.group(2)!r} (conf/{choice.group(1)}/)"
    option = re.fullmatch(r"\+?([a-z_]\w*(?:\.\w+)+)(=.*)?", text)
    if option and option.group(1).split(".")[0] in {g.split("/")[0] for g in groups} | {
        k for k in config_keys() if "." not in k
    }:
        key = option.group(1)
        if key.split(".")[0] == "hydra" or text.startswith("+"):
            return None
        if key.split(".")[0] == "trainer" and key.split(".")[1] in trainer_arguments():
            return None
        return None if key in config_keys() else f"{key} is not an option of the config (conf/)"
    return None


@pytest.mark.parametrize("page", [page_name(p) for p in PAGES])
def test_the_prose_names_files_objects_and_options_that_exist(page):
    from gptlab.runs.resume import register_resolvers

    register_resolvers()
    problems = []
    GlobalHydra.instance().clear()
    try:
        for number, span in prose_spans(ROOT / page):
            if re.match(r"(\w+=\S+ )*(python3? |torchrun |srun |pip install )", span) and "..." not in span:
                try:
                    argv = shlex.split(span)
                except ValueError:
                    continue
                problem = command_problem(argv)
            else:
                problem = reference_problem(span)
            if problem:
                problems.append(f"{page}:{number}: `{span}`: {problem}")
    finally:
        GlobalHydra.instance().clear()
    assert not problems, "\n".join(problems)


HYDRA_OWN_CHOICES = {"hydra/launcher": {"basic"}}  # choices Hydra itself provides, without a YAML here


def test_the_config_group_tables_list_every_choice():
    """A row of a config-group table (| `pos` | `learned`, `rope`, ... |) lists exactly the YAML files of the
    group: a new choice appears there, a removed one disappears."""
    groups = config_groups()
    checked = 0
    for path in PAGES:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            row = re.match(r"^\|\s*`([\w/]+)`[^|]*\|([^|]*)\|", line)
            if not row or row.group(1) not in groups:
                continue
            listed = {
                c for c in re.findall(r"`([\w.-]+)`", row.group(2)) if not re.search(r"[a-z_]\.[a-z_]", c)
            }
            real = {c for c in groups[row.group(1)] if not c.startswith("_")}
            real |= HYDRA_OWN_CHOICES.get(row.group(1), set())
            real -= {choice for group, choice in new_choices() if group == row.group(1)}
            assert listed == real, (
                f"{page_name(path)}:{number}: the `{row.group(1)}` row lists {sorted(listed)}, "
                f"conf/{row.group(1)}/ holds {sorted(real)}"
            )
            checked += 1
    assert checked


def yaml_keys(path: Path) -> list[str]:
    """The top-level keys of a config file, ``defaults`` and Hydra's own left out."""
    return [
        k for k in (yaml.safe_load(path.read_text()) or {}) if k not in ("defaults", "name") and k[0] != "_"
    ]


def test_the_positional_table_lists_each_schemes_options_and_no_other():
    """configuration.md's table of `pos=` choices names, for each, exactly the keys its YAML has (`pos.base`
    of rope, ...): an option added to or taken from conf/pos/ shows up as a difference here."""
    page = (ROOT / "docs" / "configuration.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \|[^|]*\|([^|]*)\| [^|]*\|$", page.split("| `pos=` |", 1)[1], re.M))
    assert set(rows) == {p.stem for p in (CONF / "pos").glob("*.yaml")}
    for scheme, column in rows.items():
        named = set(re.findall(r"`(\w+)`", column))
        if "the `rope` options" in column:
            named = (named - {"rope"}) | set(yaml_keys(CONF / "pos" / "rope.yaml"))
        assert named == set(yaml_keys(CONF / "pos" / f"{scheme}.yaml")), scheme


def test_every_attention_key_is_documented():
    page = (ROOT / "docs" / "configuration.md").read_text()
    for key in yaml_keys(CONF / "attention" / "default.yaml"):
        assert f"`attention.{key}`" in page, (
            f"attention.{key} (conf/attention/default.yaml) is not in configuration.md"
        )


# ---- the layout and the API reference ---------------------------------------------------------------


def gptlab_modules() -> set[str]:
    names = set()
    for path in (ROOT / "src" / "gptlab").rglob("*.py"):
        parts = list(path.relative_to(ROOT / "src").with_suffix("").parts)
        names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_the_api_reference_documents_every_module():
    documented = set()
    for page in (DOCS / "reference").glob("*.md"):
        documented |= set(re.findall(r"^::: ([\w.]+)", page.read_text(), re.M))
    modules = gptlab_modules()
    assert not modules - documented, f"modules the API reference leaves out: {sorted(modules - documented)}"
    assert not documented - modules, (
        f"the API reference names modules that do not exist: {sorted(documented - modules)}"
    )


def test_the_readme_layout_names_every_package_and_script():
    readme = (ROOT / "README.md").read_text()
    layout = re.search(r"^## Layout\n+```\n(.*?)```", readme, re.M | re.S)
    assert layout, "README.md has no layout picture under ## Layout"
    picture = layout.group(1)
    source = ROOT / "src" / "gptlab"
    for package in sorted(p.name for p in source.iterdir() if (p / "__init__.py").exists()):
        assert f"{package}/" in picture, f"the layout picture leaves out src/gptlab/{package}/"
    for module in sorted(p.name for p in source.glob("*.py") if p.name != "__init__.py"):
        assert module in picture, f"the layout picture leaves out src/gptlab/{module}"
    for script in sorted(p.stem for p in (ROOT / "scripts").glob("*.py")):
        assert re.search(rf"\b{script}\b", picture), f"the layout picture leaves out scripts/{script}.py"


# ---- what the commands print (last in this file: the runners work while the tests above run) ------------


@pytest.mark.parametrize("page", pages_that_run())
def test_the_commands_of_a_page_run_and_print_what_it_says(doc_runs, page):
    problems = []
    for block in parse(ROOT / page):
        if block.runs:
            problems += block_problems(block, doc_runs.get(block.id))
    assert not problems, "\n\n".join(problems)


def block_problems(block: Block, records: list[dict] | None) -> list[str]:
    if needs_file_permissions(block) and not file_permissions_apply():
        warnings.warn(
            f"{block.id} not checked: file permissions do not apply to this root process", stacklevel=1
        )
        return []
    if not records:
        return [f"{block.id} did not run"]
    transcript = "\n".join(
        f"$ {r['command']}  (exit {r['exit']}, {r['seconds']} s)\n{r['output'][-2500:]}" for r in records
    )
    for record in records[:-1]:
        if record["exit"] != 0:
            return [f"{block.id}: `{record['command']}` failed:\n{transcript}"]
    expected_exit = block.exit or 0
    if records[-1]["exit"] != expected_exit:
        return [
            f"{block.id}: `{records[-1]['command']}` exited with {records[-1]['exit']}, the page says "
            f"{expected_exit}:\n{transcript}"
        ]
    if block.lang in SHELL and len(records) != len(commands_of(block)):
        return [f"{block.id}: not every command ran:\n{transcript}"]
    if block.output is not None:
        missing = check_output(block.output.text, "\n".join(r["output"] for r in records))
        if missing:
            return [
                f"{block.output.id}: these lines are not what the commands print:\n"
                + "\n".join(missing)
                + f"\nwhat they printed:\n{transcript}"
            ]
    return []
