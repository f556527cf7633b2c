"""`python train.py` as a user types it, in a subprocess."""

import ast
import csv
import json
import math
import re
import sys
from datetime import datetime

import pytest
import torch
from conftest import ROOT, TINY, run_train

from gptlab.errors import ConfigError
from gptlab.tracking.wandb_runs import find_runs, read_run


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    run_dir = root / "run"
    proc = run_train(
        [
            *TINY,
            "trainer.max_steps=30",
            "trainer.val_check_interval=10",
            "optim.lr=1e-2",
            "optim.warmup_steps=5",
            "logger=[csv,wandb]",
            f"paths.root_dir={root}",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=root,
    )
    return root, run_dir, proc


def test_train_run_lowers_the_loss_and_leaves_a_checkpoint(trained):
    root, run_dir, proc = trained
    out = proc.stdout + proc.stderr
    # the closing block opens with what the command changed and the seed: pasted alone, it says its run
    closing = proc.stdout[proc.stdout.index("\nOverrides: ") + 1 :].splitlines()
    assert closing[0].startswith(f"Overrides: {' '.join(TINY)} trainer.max_steps=30 "), closing[0]
    assert closing[0].endswith(f" paths.root_dir={root} (seed 1337)") and closing[1].startswith(
        "Final validation"
    )
    assert "Parameters: total" in out and "non-embedding" in out
    assert "unigram entropy of the validation split" in out
    assert str(run_dir) in out
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "last.ckpt").is_file()
    assert list(ckpts.glob("best-*.ckpt"))
    ckpt = torch.load(ckpts / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 30
    assert ckpt["tokenizer"] == {"name": "gpt2"}
    assert ckpt["hyper_parameters"]["model"]["n_embd"] == 32
    assert (run_dir / "config_resolved.yaml").is_file()
    assert (run_dir / ".hydra" / "config.yaml").is_file()


def test_wandb_offline_run_holds_the_logged_metrics(trained):
    root, run_dir, _ = trained
    files = find_runs(run_dir / "wandb")
    assert len(files) == 1 and "offline-run-" in str(files[0])
    run = read_run(files[0])
    losses = [v for _, v in run.metric("train/loss")]
    val = run.metric("val/loss")
    # each validation at the optimizer steps done, as in the log and the checkpoint names
    assert len(losses) >= 3 and [s for s, _ in val] == [10, 20, 30]
    assert losses[-1] < losses[0] - 0.5  # the loss fell
    assert val[-1][1] < val[0][1]
    ppl = run.metric("val/ppl")
    assert math.isclose(ppl[-1][1], math.exp(val[-1][1]), rel_tol=1e-4)
    assert run.metric("lr") and run.metric("train/tokens_per_second")
    # the whole resolved config is in the run
    assert run.config["model"]["n_embd"] == 32
    assert run.config["pos"]["name"] == "learned"
    assert run.config["seed"] == 1337
    assert run.summary["unigram_entropy"] > 5
    # the greedy and the sampled continuation of the fixed prompt, two rows per validation, in a W&B table file
    assert run.summary["samples/_type"] == "table-file"
    table = json.loads((files[0].parent / "files" / run.summary["samples/path"]).read_text())
    assert table["columns"] == ["step", "decoding", "prompt", "completion"]
    assert [row[0] for row in table["data"]] == [10, 10, 20, 20, 30, 30]
    assert [row[1] for row in table["data"]] == ["greedy", "sampled (temperature 1, top-k 40)"] * 3
    assert all(row[2] == "In this case, the" and row[3] for row in table["data"])
    assert run.exit_code == 0


def test_a_run_prints_no_library_noise(trained):
    _, _, proc = trained
    out = proc.stdout + proc.stderr
    for noise in (
        "The anonymous setting has no effect",  # wandb, for the anonymous=None Lightning passes
        "'set_vital' is deprecated",  # torchdata's loader, under torch 2.13
        "LeafSpec",  # Lightning's own code, under torch 2.13
        "litlogger",  # Lightning's tip on every Trainer
        "TPU available: False",  # Lightning's line on every Trainer of a machine without a TPU
        "GPU available: False",  # and without a GPU: the model card names the device
        "`Trainer.fit` stopped",  # Lightning's end of the steps, above gptlab's "Trained 30 steps in"
    ):
        assert noise not in out, noise
    assert out.count("Token cache hit") + out.count("Preparing") == 1


def screen_lines(output: str) -> list[str]:
    """The lines a terminal shows for ``output``: a carriage return starts the line over (tqdm redraws its bars
    that way), and cursor movements (``ESC[A``) are dropped."""
    return [re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", line.split("\r")[-1]) for line in output.split("\n")]


def test_each_validation_prints_a_greedy_and_a_seeded_sampled_continuation(trained):
    from gptlab.runs.trained import load_run

    _, run_dir, proc = trained
    lines = screen_lines(proc.stdout)
    printed = {}
    for step in (10, 20, 30):
        for decoding in ("greedy", "sampled (temperature 1, top-k 40)"):
            mark = f" - step {step} {decoding}: 'In this case, the' -> "
            (line,) = [line for line in lines if mark in line]  # once per validation, on a line of its own
            assert line.startswith("[20"), line  # the log line's time stamp, no progress bar before it
            printed[step, decoding] = ast.literal_eval(line.split(mark, 1)[1])
    # samples.tsv holds the same text, a row each (newlines written as \n)
    with (run_dir / "csv" / "samples.tsv").open() as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    assert [(int(r["step"]), r["decoding"]) for r in rows] == list(printed)
    assert [r["completion"] for r in rows] == [t.replace("\n", "\\n") for t in printed.values()]
    # reproducible: the final weights, the prompt and the run's seed give the printed sample again
    trained_run = load_run(run_dir, which="last")
    tok = trained_run.tokenizer
    ids = torch.tensor([tok.encode("In this case, the")])
    out = trained_run.model.generate(
        ids, 4, temperature=1.0, top_k=40, generator=torch.Generator().manual_seed(1337)
    )
    assert tok.decode(out[0, ids.size(1) :].tolist()) == printed[30, "sampled (temperature 1, top-k 40)"]
    assert tok.decode(trained_run.model.generate(ids, 4)[0, ids.size(1) :].tolist()) == printed[30, "greedy"]


def log_time(output: str, message: str) -> datetime:
    """The time stamp of the log line with ``message``: ``[2026-11-23 17:47:53,851][logger][INFO] - ...``."""
    stamp = re.search(
        r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]\[[^]]*\]\[INFO\] - " + re.escape(message), output
    )
    return datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f")


def test_the_progress_bar_and_the_logged_rate_agree_with_each_other_and_with_wall_time(trained):
    _, run_dir, proc = trained
    with open(run_dir / "csv" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/tokens_per_second")]
    logged = {int(r["step"]): float(r["train/tokens_per_second"]) for r in rows}
    assert sorted(logged) == [10, 20, 30]
    # the progress lines (the output is a pipe, not a terminal: a line every 10 steps, no redrawn bar) show
    # the rate last logged, from the step it is logged at
    shown = [
        (int(s), float(v.replace(",", "")))
        for s, v in re.findall(r"\] - step (\d+)/30: loss [\d.]+, [^\n]*tok/s ([\d,]+)", proc.stdout)
    ]
    assert [step for step, _ in shown] == [10, 20, 30]
    assert "\r" not in proc.stdout and "\x1b[" not in proc.stdout
    for step, value in shown:
        assert value == round(logged[max(k for k in logged if k <= step)]), (step, value)

    # against wall time: the fit's wall time from the log's time stamps (the start of training, the last
    # validation's line) holds the training time (train/time) and the validations; the rates cover it
    # without a gap
    start = log_time(proc.stdout, "MFU against")
    end = log_time(proc.stdout, "step 30 validation:")
    fit_seconds = (end - start).total_seconds()
    training = float(rows[-1]["train/time"])
    tokens = float(rows[-1]["train/lengths"])
    assert tokens == 30 * 4 * 32
    assert sum(10 * 4 * 32 / rate for rate in logged.values()) == pytest.approx(training, rel=1e-6)
    # tolerance: in this run the 3 validations of 2 batches, their samples and checkpoints take less than
    # half of the fit, and the time stamps are to the millisecond
    assert 0.5 * fit_seconds < training <= fit_seconds + 0.002
    # the final line: the training rate over the whole run, and the rate of the whole run's wall time
    wall_rate, training_rate = (
        float(v.replace(",", ""))
        for v in re.search(
            r"Trained 30 steps in \d+ s: ([\d,]+) tokens/s of wall time .*; training rate ([\d,]+) tokens/s",
            proc.stdout,
        ).groups()
    )
    assert training_rate == round(tokens / training)
    assert wall_rate <= tokens / fit_seconds < training_rate
    # and the rate after the first step, whose warm-up the whole run's rate includes: the first step and the
    # 29 after it make up the training time (to the printed digits: 0.05 s, and the rate's last digit)
    after, first = re.search(
        r"training rate [\d,]+ tokens/s \(validation excluded; ([\d,]+) after the first step, which took "
        r"([\d.]+) s\)$",
        proc.stdout,
        re.M,
    ).groups()
    after_rate, first_seconds = float(after.replace(",", "")), float(first)
    assert first_seconds <= 10 * 4 * 32 / logged[10] + 0.05  # within the first logged window
    assert first_seconds + 29 * 4 * 32 / after_rate == pytest.approx(training, abs=0.05 + 0.01 * training)


def test_the_run_says_before_its_first_step_the_least_time_its_steps_can_take(trained):
    """The MFU line names the FLOPs of the steps to train and their time at the peak it names: a model too
    large for the machine shows its hours before the first step. Here 30 steps of 4 x 32 tokens, at the FLOPs
    per token the card's line gives (the MFU line does not say them again, nor in another form)."""
    from gptlab.training.metrics import duration

    _, _, proc = trained
    scale = {"": 1.0, "k": 1e3, "M": 1e6, "B": 1e9, "T": 1e12, "P": 1e15}
    (per_token, per_token_unit), *more = re.findall(
        r"^Training FLOPs per token at context 32: ([\d.]+)([kMBTP]?) ", proc.stdout, re.M
    )
    assert not more and proc.stdout.count("FLOPs per token") == 1, proc.stdout[:3000]
    peak, total, total_unit, shown = re.search(
        r"MFU against ([\d.]+) GFLOP/s per device \([^;]*\): the 30 steps to train are "
        r"([\d.]+)([kMBTP]?) FLOPs, (.+?) at that peak \(a lower bound: a run reaches a fraction of the peak\)$",
        proc.stdout,
        re.M,
    ).groups()
    total_flops = float(total) * scale[total_unit]
    # to the printed digits (four: 41.35M)
    assert total_flops == pytest.approx(30 * 4 * 32 * float(per_token) * scale[per_token_unit], rel=2e-3)
    assert shown == duration(total_flops / (float(peak) * 1e9))
    # likewise the output layer: the card's memory line says what loss.impl=auto took, and no other line
    # says it again
    assert "(loss.impl=auto: chunked, " in proc.stdout
    assert "Output layer and loss" not in proc.stdout + proc.stderr
    assert [duration(s) for s in (0.031, 48, 720, 3 * 3600 + 300, 2.4 * 86400)] == [
        "0.031 s",
        "48 s",
        "12 min",
        "3 h 05 min",
        "2.4 days",
    ]


def test_second_run_reuses_the_token_cache(trained):
    root, _, _ = trained
    proc = run_train(
        [
            *TINY,
            "trainer.max_steps=2",
            "trainer.val_check_interval=2",
            "logger=csv",
            f"paths.root_dir={root}",
            f"hydra.run.dir={root / 'run2'}",
        ],
        cwd=root,
    )
    out = proc.stdout + proc.stderr
    assert "Token cache hit" in out and "Preparing" not in out
    assert (root / "run2" / "csv" / "metrics.csv").is_file()


@pytest.mark.parametrize(
    "override,expected",
    [
        ("trainer.max_step=5", "gptlab: error: trainer has no key 'max_step' (trainer.max_step=5)."),
        ("pos=rotary", "Could not find 'pos/rotary'"),
        ("activation=gleu", "Could not find 'activation/gleu'"),
        ("model.n_head=3", "n_embd=32 is not divisible by model.n_head=3"),
        ("data.path=/no/such/file.txt", "matches no file"),
        ("model.vocab_size=1000", "tokenizer=gpt2 has 50257 ids but model.vocab_size=1000"),
        ("data.block_size=64", "longer than the learned position table"),
        ("+trainer.max_epoch=3", "Did you mean trainer.max_epochs"),
    ],
)
def test_bad_input_fails_fast_with_the_fix(tmp_path, override, expected):
    proc = run_train(
        [*TINY, override, f"paths.root_dir={tmp_path}", f"hydra.run.dir={tmp_path / 'r'}"],
        cwd=tmp_path,
        check=False,
        timeout=600,
    )
    assert proc.returncode != 0
    assert expected in proc.stdout + proc.stderr
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_generate_script_continues_a_prompt_from_a_run(trained):
    import subprocess
    import sys

    from conftest import ROOT

    from gptlab.runs.trained import load_run

    root, run_dir, _ = trained
    best = load_run(run_dir, which="best")
    assert best.checkpoint.name.startswith("best-") and best.run_dir == run_dir
    model, tok = best.model, best.tokenizer
    ids = torch.tensor([tok.encode("The")])
    expected = tok.decode(model.generate(ids, 5)[0, 1:].tolist())
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "generate.py"),
            f"ckpt={run_dir}",
            "prompt=The",
            "max_new_tokens=5",
            "temperature=0",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    # greedy decoding: the script prints exactly the model's argmax continuation (cut at <|endoftext|>)
    assert proc.stdout.splitlines()[0] == ("The" + expected.split("<|endoftext|>")[0]).splitlines()[0]
    sampled = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "generate.py"),
            f"ckpt={run_dir}",
            "prompt=The",
            "max_new_tokens=5",
            "temperature=1.0",
            "top_k=20",
            "samples=2",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    assert sampled.stdout.count("-" * 40) == 2


@pytest.mark.parametrize(
    ("override", "shown"),
    [
        ("temperature=-1", "callbacks.sample_generation.temperature=-1 is negative: use 0 for the greedy"),
        (
            "top_k=-1",
            "callbacks.sample_generation.top_k=-1 must be a positive number of tokens (e.g. 40), or null",
        ),
        ("top_p=1.5", "callbacks.sample_generation.top_p=1.5 must be above 0 and at most 1 (e.g. 0.95"),
        ("top_p=0", "callbacks.sample_generation.top_p=0 must be above 0 and at most 1"),
    ],
)
def test_a_sampled_continuation_that_cannot_be_drawn_as_named_is_refused(make_cfg, override, shown):
    """A sampling setting the sampler would read as another (a top_p above 1 as no nucleus) is refused with
    its fix when the callbacks are made, before the trainer."""
    from gptlab.training.callbacks import instantiate_callbacks

    with pytest.raises(ConfigError) as refused:
        instantiate_callbacks(make_cfg(f"callbacks.sample_generation.{override}").callbacks)
    assert shown in str(refused.value)


# ---- scripts/generate.py's arguments ----------------------------------------------------------------------


@pytest.fixture
def generate_script():
    import sys

    from conftest import load_script

    yield load_script("generate")
    sys.modules.pop("generate", None)


@pytest.mark.parametrize(
    "argv,shown",
    [
        (["promt=The sky"], "generate: error: unknown option 'promt'. Its options: ckpt, prompt, "),
        (["promt=The sky"], "Did you mean prompt=The sky?"),
        (
            ["--promt", "x"],
            "unrecognized argument --promt: options are given as key=value. Did you mean prompt=...?",
        ),
        (
            ["run", "temperature=hot"],
            "temperature=hot is not a valid temperature: it must be a number (e.g. temperature=1.0)",
        ),
        (
            ["run", "top_k=abc"],
            "top_k=abc is not a valid top_k: it must be an integer or null (e.g. top_k=40)",
        ),
        (["run", "ckpt=other"], "two checkpoints given"),
        ([], "no checkpoint given: ckpt=<run dir or checkpoint> (or the path alone)"),
        # values of the right type that cannot work: refused before the checkpoint is read, not sampled as
        # something else (a negative temperature as greedy, top_p=1.5 as no nucleus, nothing generated)
        (["run", "temperature=-1"], "temperature=-1 must be 0 (greedy decoding) or more"),
        (["run", "top_p=1.5"], "top_p=1.5 must be above 0 and at most 1 (e.g. top_p=0.95"),
        (["run", "top_p=0"], "top_p=0 must be above 0 and at most 1"),
        (["run", "top_k=-5"], "top_k=-5 must be a positive number of tokens (e.g. top_k=40), or null (or 0)"),
        (["run", "max_new_tokens=-3"], "max_new_tokens=-3 must be a positive number of tokens"),
        (["run", "samples=0"], "samples=0 must be a positive number of continuations"),
        (["run", "which=lst"], "which='lst' must be best (the best checkpoint by validation loss) or last."),
        (
            ["no-such-run"],
            "generate: error: no-such-run does not exist: pass a run directory or a checkpoint.",
        ),
        (  # a file of the run that is not a checkpoint: said so, without the advice to delete it
            [str(ROOT / "docs" / "tour" / "val_loss.png")],
            "val_loss.png cannot be read: it is not a PyTorch checkpoint (it begins b'\\x89PNG",
        ),
    ],
)
def test_generate_refuses_a_mistyped_option_with_the_closest_one(generate_script, capsys, argv, shown):
    with pytest.raises(SystemExit) as ended:
        generate_script.main(argv)
    err = capsys.readouterr().err
    assert ended.value.code == 2
    assert err.startswith("usage: python scripts/generate.py ckpt=") and shown in err, err
    assert "Traceback" not in err and "delete it" not in err


def test_generate_has_a_help_page_with_every_option_and_its_default(generate_script, capsys):
    with pytest.raises(SystemExit) as ended:
        generate_script.main(["--help"])
    out = capsys.readouterr().out
    assert ended.value.code == 0
    assert out.startswith("usage: python scripts/generate.py") and "Continue a prompt" in out
    for line in ("prompt='In this case, the'", "temperature=1.0", "top_k=40", "which='best'"):
        assert f"\n  {line}\n" in out, out


def test_generate_takes_a_run_directory_as_a_bare_path_and_says_which_checkpoint(
    trained, generate_script, capsys
):
    _, run_dir, _ = trained
    args = ["prompt=The", "max_new_tokens=4", "temperature=0"]
    generate_script.main([str(run_dir), *args])
    by_path = capsys.readouterr()
    best = next((run_dir / "checkpoints").glob("best-*.ckpt"))
    assert by_path.err.splitlines()[0] == f"# {best} (the run's best checkpoint)"
    generate_script.main([f"ckpt={best}", *args])
    by_file = capsys.readouterr()
    assert by_file.err.splitlines()[0] == f"# {best}"  # a checkpoint given is the one read: nothing to say
    assert by_file.out == by_path.out and by_path.out.startswith("The")


@pytest.mark.parametrize(
    "args,said",
    [
        (
            [],
            "# sampled at temperature=1, top_k=40, top_p=null (no nucleus), seed=0; at most 4 new tokens, "
            "ending early at <|endoftext|>",
        ),
        (
            ["temperature=0.7", "top_k=0", "top_p=0.9", "seed=3"],
            "# sampled at temperature=0.7, top_k=null (the whole vocabulary), top_p=0.9, seed=3; at most 4 new "
            "tokens, ending early at <|endoftext|>",
        ),
        (
            ["temperature=0"],
            "# greedy decoding (temperature=0: the likeliest token each time; top_k and top_p do not apply); at "
            "most 4 new tokens, ending early at <|endoftext|>",
        ),
    ],
)
def test_generate_says_how_it_chose_the_tokens(trained, generate_script, capsys, args, said):
    _, run_dir, _ = trained
    generate_script.main([str(run_dir), "prompt=The", "max_new_tokens=4", *args])
    printed = capsys.readouterr()
    assert printed.err.splitlines()[1:] == [said]
    assert said not in printed.out  # the text alone on stdout, for a file or a pipe


def test_generate_shows_the_prompt_apart_on_a_terminal_and_plain_elsewhere(
    trained, generate_script, monkeypatch
):
    import io

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    _, run_dir, _ = trained
    args = [str(run_dir), "prompt=The for", "max_new_tokens=4", "samples=2"]
    printed = {}
    for name, stream in (("pipe", io.StringIO()), ("terminal", Terminal())):
        monkeypatch.setattr(sys, "stdout", stream)
        generate_script.main(args)
        printed[name] = stream.getvalue()
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setattr(sys, "stdout", Terminal())
    generate_script.main(args)
    printed["NO_COLOR"] = sys.stdout.getvalue()
    samples = [text for text in printed["pipe"].split("-" * 40 + "\n") if text]
    assert len(samples) == 2 and all(text.startswith("The for") for text in samples)
    # the same text, the prompt bold: the continuation after it is what the model wrote
    assert printed["terminal"] == printed["pipe"].replace("The for", "\x1b[1mThe for\x1b[0m")
    assert printed["terminal"].count("\x1b[1mThe for\x1b[0m") == 2
    assert printed["NO_COLOR"] == printed["pipe"]


def test_progress_is_a_bar_on_a_terminal_and_lines_elsewhere(monkeypatch):
    import io

    from gptlab.errors import ConfigError
    from gptlab.training.callbacks import StepLines, StepProgressBar, progress_bar

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stdout", Terminal())
    assert isinstance(progress_bar(), StepProgressBar)
    monkeypatch.setattr(sys, "stdout", io.StringIO())  # a file, a pipe, a SLURM log
    lines = progress_bar(every_n_steps=5)
    assert isinstance(lines, StepLines) and lines.every_n_steps == 5
    assert isinstance(progress_bar("bar"), StepProgressBar) and isinstance(progress_bar("lines"), StepLines)
    with pytest.raises(
        ConfigError, match=r"callbacks.progress_bar.style='line' is not one of auto, bar, lines"
    ):
        progress_bar("line")
    with pytest.raises(ConfigError, match=r"callbacks.progress_bar.every_n_steps=0 must be a whole number"):
        progress_bar(every_n_steps=0)
    assert progress_bar("bar", refresh_rate=0).refresh_rate == 0  # Lightning's way to draw no bar
    with pytest.raises(ConfigError, match=r"refresh_rate=-1 must be a whole number of steps, 0 or more"):
        progress_bar(refresh_rate=-1)


def test_the_closing_overrides_line_of_a_run_outside_hydra_says_it_took_the_defaults():
    from gptlab.tasks.gpt import overrides_line

    assert overrides_line(7) == "Overrides: none, the defaults (seed 7)"
