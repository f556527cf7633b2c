"""The length study: the evaluation after training, scripts/eval_length.py on a checkpoint, W&B logging, and
the sweep summary."""

import json
import logging
import math
import os
import shlex
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, run_train, signal_when_held, strict_json

from gptlab.comparison import length_table as sweep
from gptlab.comparison.records import read_run_dir
from gptlab.data.tokenizers import CharTokenizer
from gptlab.evaluation import length
from gptlab.model.config import GPTConfig
from gptlab.model.gpt import GPT
from gptlab.runs.layout import last_checkpoint
from gptlab.tracking.wandb_runs import find_runs, read_run

TINY_RUN = [
    "tokenizer=char",
    "model.n_layer=1",
    "model.n_head=2",
    "model.n_embd=32",
    "model.block_size=32",
    "data.batch_size=8",
    "trainer.max_steps=30",
    "trainer.val_check_interval=30",
    "trainer.limit_val_batches=4",  # 4 x 8 windows of 32 + 1 tokens: the first 1025 validation tokens
    "eval_length.max_tokens=1025",
    "optim.lr=1e-2",
    "optim.warmup_steps=5",
    "callbacks.sample_generation.max_new_tokens=2",
    "logger.wandb.group=length_test",
    "eval_length.enabled=true",
    "eval_length.factors=[1,2,4]",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny RoPE model trained in-process (as the training task runs it), with the length hook on."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from gptlab.tasks.gpt import run

    root = tmp_path_factory.mktemp("length")
    run_dir = root / "run"
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(
            "train",
            overrides=[*TINY_RUN, "pos=rope", f"paths.root_dir={root}", f"paths.output_dir={run_dir}"],
        )
    # A W&B run already open in the process, as a notebook's would be: the training run must log to a run of
    # its own, not into this one (Lightning's WandbLogger reuses an open run).
    import wandb

    (root / "other").mkdir()
    other = wandb.init(project="other", dir=str(root / "other"), mode="offline", reinit="create_new")
    other.log({"other/metric": 1.0})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 32-wide model: one thread is faster, and far faster on a busy machine
    try:
        metrics = run(cfg)
    finally:
        torch.set_num_threads(threads)
        other.finish()
        # finish() returns before W&B's service has flushed and closed the runs' files (a small run's records
        # can all still be in its buffer); the tests read those files, so wait until the service has ended
        wandb.teardown()
    return root, run_dir, metrics


def test_evaluation_after_training_matches_the_validation_loss_and_extends_it(trained):
    _, run_dir, metrics = trained
    result = json.loads((run_dir / "eval_length" / "length.json").read_text())
    assert result["pos"] == "rope" and result["train_context"] == 32 and result["factors"] == [1, 2, 4]
    # At 1x the evaluation sees exactly the validation windows the trainer saw.
    assert result["variants"]["rope"]["1"]["windows"] == 32
    assert result["variants"]["rope"]["1"]["loss"] == pytest.approx(metrics["val/loss"], abs=1e-4)
    assert metrics["length/loss@1x"] == result["variants"]["rope"]["1"]["loss"]
    # and the same bytes: bits per byte at 1x is the trainer's val/bpb
    assert result["variants"]["rope"]["1"]["bpb"] == pytest.approx(metrics["val/bpb"], abs=1e-4)
    assert metrics["length/bpb@1x"] == result["variants"]["rope"]["1"]["bpb"]
    assert set(result["variants"]) == {"rope", "rope+linear", "rope+ntk", "rope+yarn"}
    for entries in result["variants"].values():
        for factor, entry in entries.items():
            assert entry["context"] == 32 * int(factor)
            assert len(entry["loss_by_position"]) == entry["context"]
            assert math.isfinite(entry["loss"]) and entry["ppl"] == pytest.approx(math.exp(entry["loss"]))
            assert entry["loss"] == pytest.approx(np.mean(entry["loss_by_position"]), abs=1e-4)
    assert result["variants"]["rope+yarn"]["4"]["loss"] != result["variants"]["rope"]["4"]["loss"]
    for png in ("loss_vs_length.png", "loss_by_position.png"):
        assert (run_dir / "eval_length" / png).read_bytes()[:4] == b"\x89PNG"


def test_evaluation_is_logged_to_the_runs_wandb_run(trained):
    _, run_dir, _ = trained
    result = json.loads((run_dir / "eval_length" / "length.json").read_text())
    (wandb_file,) = find_runs(run_dir / "wandb")
    logged = read_run(wandb_file)
    assert logged.summary["val/loss"] == pytest.approx(result["variants"]["rope"]["1"]["loss"], abs=1e-4)
    # the run open before it got none of its records
    (other_file,) = find_runs(run_dir.parent / "other" / "wandb")
    other = read_run(other_file)
    assert not [k for k in other.summary if k.startswith(("val/", "train/", "length/"))]
    assert other.project == "other" and other.run_id != logged.run_id
    assert logged.summary["length/loss@2x"] == pytest.approx(result["variants"]["rope"]["2"]["loss"])
    assert logged.summary["length/rope+yarn/loss@4x"] == pytest.approx(
        result["variants"]["rope+yarn"]["4"]["loss"]
    )
    assert logged.summary["length/loss_by_position/_type"] == "image-file"


def test_script_evaluates_a_checkpoint_and_logs_a_wandb_run_in_the_same_group(trained, tmp_path):
    root, run_dir, _ = trained
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "eval_length.py"),
            str(last_checkpoint(run_dir)),
            "--factors",
            "1",
            "2",
            "8",
            "--max-tokens",
            "3000",
            "--out",
            str(out),
        ],
        cwd=root,
        env={**os.environ, "OMP_NUM_THREADS": "1"},  # a tiny model: one thread is faster on a busy machine
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| rope |" in proc.stdout and "8x (256)" in proc.stdout
    result = json.loads((out / "length.json").read_text())
    assert result["factors"] == [1, 2, 8] and result["validation_tokens"] == 3000
    assert result["variants"]["rope"]["8"]["windows"] == (3000 - 1) // 256
    assert (out / "loss_vs_length.png").is_file() and (out / "loss_by_position.png").is_file()
    runs = [read_run(p) for p in find_runs(run_dir / "wandb")]
    evals = [r for r in runs if r.job_type == "eval_length"]
    assert len(evals) == 1
    train_run = next(r for r in runs if r.job_type == "train")
    assert evals[0].group == train_run.group == "length_test"
    assert evals[0].summary["length/loss@8x"] == pytest.approx(result["variants"]["rope"]["8"]["loss"])


# 12, 6 and 3 windows at 1x, 2x and 4x a context of 32: 128 tokens a batch divide them evenly (4, 2 and 1 a
# batch), 320 at no length (10, 5 and 2 a batch: last batches of 2, 1 and 1).
@pytest.mark.parametrize("batch_tokens", [128, 320])
def test_padding_the_last_batch_changes_no_figure_the_study_reports(batch_tokens, monkeypatch):
    """The study pads its smaller last batch to the others' size where it attends through compiled
    FlexAttention (one kernel per batch size). Forced here on the CPU's route: the losses by position, the
    loss, perplexity, bits per byte, windows, tokens and bytes are those without padding, to the bit, and the
    mean of each window's own losses; only the batches the model ran are larger."""
    torch.manual_seed(0)
    chars = list("abcdefghijklmnopqrstuvwxyz .,;:!?'-éüß中文")  # bytes per token from 1 to 3
    tokenizer = CharTokenizer(chars)
    model = GPT(
        GPTConfig(vocab_size=tokenizer.vocab_size, block_size=32, n_layer=1, n_head=2, n_embd=32, pos="alibi")
    )
    model.eval()
    tokens = np.random.default_rng(0).integers(0, tokenizer.vocab_size, 12 * 32 + 1)
    options = length.LengthEvalOptions(factors=[1, 2, 4], batch_tokens=batch_tokens)
    batches: list[int] = []
    model.register_forward_hook(lambda module, args, output: batches.append(args[0].size(0)))

    def study(padded: bool) -> tuple[dict, list[int]]:
        monkeypatch.setattr(length, "runs_compiled_flex_attention", lambda model, device: padded)
        batches.clear()
        result = length.evaluate_lengths(model, tokens, 32, options, tokenizer)
        figures = {
            f: {k: v for k, v in e.items() if k != "seconds"} for f, e in result["variants"]["alibi"].items()
        }
        return figures, list(batches)

    plain, plain_batches = study(padded=False)
    padded, padded_batches = study(padded=True)
    if batch_tokens == 128:
        assert plain_batches == padded_batches == [4, 4, 4, 2, 2, 2, 1, 1, 1]
    else:
        assert plain_batches == [10, 2, 5, 1, 2, 1]
        assert padded_batches == [10, 10, 5, 5, 2, 2]
    assert padded == plain
    for factor, entry in padded.items():
        context = int(factor) * 32
        windows = torch.as_tensor(tokens).unfold(0, context + 1, context)  # (12 * 32 / context, context + 1)
        with torch.no_grad():  # each window alone
            each = [F.cross_entropy(model(w[None, :-1])[0][0], w[1:], reduction="none") for w in windows]
        by_position = torch.stack(each).double().mean(0)
        assert entry["windows"] == len(windows) and entry["tokens"] == 12 * 32
        np.testing.assert_allclose(entry["loss_by_position"], by_position.numpy(), atol=1e-5)
        assert entry["loss"] == pytest.approx(float(by_position.mean()), rel=1e-6)
        assert math.isfinite(entry["bpb"])  # reported, the same as without padding (above)


def test_learned_positions_say_they_cannot_run_longer(caplog):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=20, block_size=16, n_layer=1, n_head=2, n_embd=16, pos="learned"))
    tokens = np.random.default_rng(0).integers(0, 20, 500)
    with caplog.at_level(logging.INFO, logger="gptlab.evaluation.length"):
        result = length.evaluate_lengths(model, tokens, 16, length.LengthEvalOptions(factors=[1, 2, 4]))
    # one line for the factors it cannot run at, not one each
    (skipped,) = [r.getMessage() for r in caplog.records if "not evaluated" in r.getMessage()]
    assert skipped == (
        "learned at 2x, 4x (32, 64 tokens): not evaluated: pos=learned has a table of 16 positions and no vector "
        "for the positions past it, so it cannot run at 32 tokens (and so at the longer ones)"
    )
    entries = result["variants"]["learned"]
    assert math.isfinite(entries["1"]["loss"])
    for factor in ("2", "4"):
        assert "loss" not in entries[factor]
        assert (
            "table of 16 positions" in entries[factor]["error"] and "cannot run" in entries[factor]["error"]
        )
    assert "cannot run" in length.format_table(result)


@pytest.mark.parametrize("pos", ["learned", "rope"])
def test_the_figures_a_stopped_study_names_as_missing_are_those_the_whole_study_gives(pos):
    """The names a study stopped by a signal lists as missing come from planned_metrics, which runs no
    model: they are exactly those the whole study reports, with the contexts a position table or the split
    rules out, and the passkey lengths its prompt does not fit, left out."""
    from gptlab.evaluation import passkey

    torch.manual_seed(0)
    text = passkey.INTRO + passkey.FILLER + passkey.KEY_SENTENCE + passkey.QUESTION + "0123456789"
    tokenizer = CharTokenizer(sorted(set(text)))
    model = GPT(
        GPTConfig(vocab_size=tokenizer.vocab_size, block_size=64, n_layer=1, n_head=2, n_embd=32, pos=pos)
    ).eval()
    tokens = np.random.default_rng(0).integers(0, tokenizer.vocab_size, 200)  # no window of 4 x 64
    options = length.LengthEvalOptions(factors=[1, 2, 4], rope_scalings=["ntk"])
    passkey_options = passkey.PasskeyOptions(depths=1, trials=1)
    planned = length.planned_metrics(model, tokens, 64, options, tokenizer, passkey_options)
    whole = length.evaluate_lengths(model, tokens, 64, options, tokenizer)
    whole["passkey"] = passkey.evaluate_passkey(model, tokenizer, 64, [1, 2, 4], passkey_options, ["ntk"])
    assert sorted(planned) == sorted(length.summary_metrics(whole))
    if pos == "rope":  # 1x too short for a prompt, 4x for the split: both kinds of gap are exercised
        assert "length/rope+ntk/bpb@2x" in planned and "passkey/rope+ntk/acc@4x" in planned
        assert "length/loss@4x" not in planned and "passkey/acc@1x" not in planned
    else:
        assert planned == ["length/loss@1x", "length/ppl@1x", "length/bpb@1x"]


@pytest.mark.parametrize("pos,scaled", [("xpos", True), ("alibi", False)])
def test_every_scheme_with_context_scalings_gets_the_scaling_study(pos, scaled):
    """The study asks the scheme for its context scalings (xPos has RoPE's), and leaves it as trained."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=20, block_size=16, n_layer=1, n_head=2, n_embd=32, pos=pos)).eval()
    tokens = np.random.default_rng(0).integers(0, 20, 200)
    before = model(torch.as_tensor(tokens[None, :40]))[0]
    result = length.evaluate_lengths(model, tokens, 16, length.LengthEvalOptions(factors=[1, 2]))
    expected = {pos} | ({f"{pos}+{s}" for s in ("linear", "ntk", "yarn")} if scaled else set())
    assert set(result["variants"]) == expected
    if scaled:  # a stretched scheme scores the same windows differently
        assert result["variants"][f"{pos}+linear"]["2"]["loss"] != result["variants"][pos]["2"]["loss"]
    torch.testing.assert_close(model(torch.as_tensor(tokens[None, :40]))[0], before)


def test_sweep_summary_averages_seeds(trained, tmp_path):
    _, run_dir, _ = trained
    result = json.loads((run_dir / "eval_length" / "length.json").read_text())
    for seed, shift in ((0, 0.0), (1, 0.2)):  # two jobs of one sweep, the second 0.2 nats worse
        job = tmp_path / f"{seed}-rope-seed{seed}"
        (job / "eval_length").mkdir(parents=True)
        moved = json.loads(json.dumps(result))
        for entries in moved["variants"].values():
            for entry in entries.values():
                entry["loss"] += shift
                entry["loss_by_position"] = [v + shift for v in entry["loss_by_position"]]
        (job / "eval_length" / "length.json").write_text(json.dumps(moved))
        (job / "config_resolved.yaml").write_text(f"seed: {seed}\n")
    table = sweep.summarize(tmp_path, plot=tmp_path / "sweep.png")
    # the two runs differ only by seed: one condition, with two seeds
    row = next(line for line in table.splitlines() if line.startswith("| all runs |"))
    mean = result["variants"]["rope"]["2"]["loss"] + 0.1
    assert f"{mean:.3f} ± {np.std([0, 0.2], ddof=1):.3f}" in row and "| 2 |" in row
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    summary = json.loads((tmp_path / "length_summary.json").read_text())
    assert summary["table"]["all runs +yarn"]["1"]["n"] == 2  # scaled variants share the 1x value


def tiny_model(pos: str, diverged: str | None = None) -> GPT:
    """A tiny model; ``diverged``: as a badly diverged run leaves it, its (tied) token embedding grown 10^4-fold
    (``"huge"``: a loss of thousands of nats, past math.exp's range of about 709) or holding a NaN (``"nan"``)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=20, block_size=16, n_layer=1, n_head=2, n_embd=16, pos=pos)).eval()
    with torch.no_grad():
        if diverged == "huge":
            model.transformer.wte.weight.mul_(1e4)
        elif diverged == "nan":
            model.transformer.wte.weight[3, 0] = math.nan
    return model


def test_a_loss_past_exps_range_gives_an_infinite_perplexity_written_as_inf(tmp_path):
    """The length study of a badly diverged model reports (it raised OverflowError in math.exp): its
    perplexity is inf, written "inf" in a length.json that a strict parser reads; the comparison reads that
    perplexity as missing, never as 0."""
    from gptlab.evaluation.long_context import read_length_study

    tokens = np.random.default_rng(0).integers(0, 20, 200)
    options = length.LengthEvalOptions(factors=[1, 2], rope_scalings=["ntk"])
    result = length.evaluate_lengths(tiny_model("rope", "huge"), tokens, 16, options)
    for name, factor in (("rope", "1"), ("rope", "2"), ("rope+ntk", "2")):
        entry = result["variants"][name][factor]
        assert entry["loss"] > 709 and entry["ppl"] == math.inf
    assert "(ppl inf)" in length.format_table(result)
    (tmp_path / "config_resolved.yaml").write_text("seed: 0\n")
    (path, *plots) = length.write_outputs(result, tmp_path / "eval_length")
    written = strict_json(path)["variants"]["rope"]["2"]
    assert written["ppl"] == "inf" and written["loss"] == pytest.approx(
        result["variants"]["rope"]["2"]["loss"]
    )
    assert plots and all(p.read_bytes()[:4] == b"\x89PNG" for p in plots)
    assert read_length_study(tmp_path) == {"ppl@1x": None, "ppl@2x": None}


def test_the_passkey_study_of_a_diverged_model_writes_its_nan_figures_as_nan(tmp_path):
    """passkey.json of a model holding a NaN: its key log-probabilities are "nan" in strict JSON (a NaN
    raised there, and nothing was written), read back as NaN by the long-context report."""
    from gptlab.evaluation import passkey
    from gptlab.evaluation.long_context import read_key_logprob, read_passkey

    text = passkey.INTRO + passkey.FILLER + passkey.KEY_SENTENCE + passkey.QUESTION + "0123456789"
    tokenizer = CharTokenizer(sorted(set(text)))
    model = GPT(
        GPTConfig(vocab_size=tokenizer.vocab_size, block_size=64, n_layer=1, n_head=2, n_embd=16, pos="rope")
    )
    with torch.no_grad():
        model.transformer.wte.weight[3, 0] = math.nan
    options = passkey.PasskeyOptions(depths=1, trials=1)
    study = passkey.evaluate_passkey(model.eval(), tokenizer, 64, [2, 4], options, [])
    (path, *_) = passkey.write_outputs(study, tmp_path / "eval_length")
    written = strict_json(path)["metrics"]
    assert written["passkey/key_logprob@2x"] == "nan" and written["passkey/acc@2x"] == 0.0
    assert math.isnan(read_key_logprob(tmp_path)["key_logprob@4x"])
    assert read_passkey(tmp_path) == {"passkey@2x": 0.0, "passkey@4x": 0.0}


def test_sweep_summary_of_a_diverged_run_and_a_length_no_run_measured(tmp_path):
    """length_summary.json is strict JSON: a diverged run's mean (NaN losses) is "nan"; a length that no run of
    a row was evaluated at has mean and std null and the reason beside; the table shows the first as nan and
    the second as an empty cell, never as 0."""
    tokens = np.random.default_rng(0).integers(0, 20, 200)
    for lr, diverged, factors in (("0.01", None, [1, 2, 4]), ("10", "nan", [1, 2])):
        job = tmp_path / f"lr{lr}"
        model = tiny_model("alibi", diverged)
        options = length.LengthEvalOptions(factors=factors)
        length.write_outputs(length.evaluate_lengths(model, tokens, 16, options), job / "eval_length")
        strict_json(job / "eval_length" / "length.json")
        (job / "config_resolved.yaml").write_text(f"seed: 0\noptim:\n  lr: {lr}\n")
        (job / ".hydra").mkdir()
        (job / ".hydra" / "overrides.yaml").write_text(f"- optim.lr={lr}\n")  # a sweep's job
    table = sweep.summarize(tmp_path, plot=tmp_path / "sweep.png")
    summary = strict_json(tmp_path / "length_summary.json")
    diverged = summary["table"]["optim.lr=10"]
    assert diverged["1"] == {"mean": "nan", "std": 0.0, "n": 1, "error": None}
    assert diverged["4"] == {"mean": None, "std": None, "n": 0, "error": sweep.NOT_MEASURED}
    healthy = summary["table"]["optim.lr=0.01"]
    assert all(math.isfinite(healthy[f]["mean"]) and healthy[f]["n"] == 1 for f in ("1", "2", "4"))
    row = next(line for line in table.splitlines() if line.startswith("| optim.lr=10 |"))
    assert row.endswith("| nan ± 0.000 | nan ± 0.000 |  |")
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"


def test_bad_evaluation_options_are_refused():
    from gptlab.errors import ConfigError

    with pytest.raises(
        ConfigError, match=r"eval_length.factors=\[0, 2\] must be a non-empty list of positive"
    ):
        length.LengthEvalOptions(factors=[0, 2])
    with pytest.raises(ConfigError, match=r"eval_length.rope_scalings has \['dynamic'\]"):
        length.LengthEvalOptions(rope_scalings=["dynamic"])
    with pytest.raises(
        ConfigError,
        match=r"eval_length does not take option\(s\) eval_length.factor\..*Did you mean eval_length.factors\?",
    ):
        length.LengthEvalOptions.from_dict({"enabled": True, "factor": [2]})


def test_eval_length_enabled_is_true_or_false(make_cfg):
    """A value Hydra reads as a string is refused, not taken as on."""
    from gptlab.config import parse_gpt
    from gptlab.errors import ConfigError

    with pytest.raises(ConfigError, match=r"eval_length.enabled='sometimes' must be true or false"):
        parse_gpt(make_cfg("eval_length.enabled=sometimes"))


def test_the_eval_length_nodes_yaml_states_exactly_its_options_defaults(make_cfg):
    """The defaults are LengthEvalOptions' and PasskeyOptions'; conf/train.yaml's eval_length node and its
    passkey node list the same keys (so that eval_length.<key>=... works without +) with the same values. A key
    in one and not the other, or a default changed in one place only, fails here."""
    import dataclasses

    from omegaconf import OmegaConf

    from gptlab.evaluation.options import LengthEvalOptions, PasskeyOptions

    def plain(options) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(options).items()}

    node = OmegaConf.to_container(make_cfg().eval_length)
    passkey_node = node.pop("passkey")
    assert node == {"enabled": False, **plain(LengthEvalOptions())}
    assert passkey_node == plain(PasskeyOptions())
    # and each is an override as typed
    cfg = make_cfg("eval_length.rope_scalings=[ntk]", "eval_length.passkey.key_digits=3")
    assert LengthEvalOptions.from_dict(OmegaConf.to_container(cfg.eval_length)).rope_scalings == ["ntk"]
    assert PasskeyOptions.from_dict(OmegaConf.to_container(cfg.eval_length.passkey)).key_digits == 3


@pytest.mark.parametrize(
    "pos,pictures",
    [
        ("learned", {"table", "similarity"}),
        ("sinusoidal", {"table", "similarity"}),
        ("rope", {"similarity"}),
        ("xpos", {"similarity"}),
        ("alibi", {"bias"}),
        ("relative", {"bias"}),
        ("fire", {"bias"}),
        ("nope", set()),
    ],
)
def test_position_pictures(pos, pictures, tmp_path):
    from gptlab.evaluation import plots

    model = GPT(GPTConfig(vocab_size=5, block_size=24, n_layer=1, n_head=6, n_embd=24, pos=pos))
    written = plots.plot_scheme(model, tmp_path)
    assert {p.stem.split("_")[-1] for p in written} == pictures
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in written)
    similarity = plots.position_similarity(model, 24)
    if similarity is not None:
        torch.testing.assert_close(similarity.diagonal(), torch.ones(24))
    if pos == "rope":  # rotary similarity depends on i - j only: constant along each diagonal
        torch.testing.assert_close(similarity.diagonal(3)[1:], similarity.diagonal(3)[:-1].clone())
    bias = plots.attention_bias(model, 24)
    if bias is not None:
        assert bias.shape == (6, 24, 24)
        assert torch.isnan(bias[:, 0, 1:]).all() and not torch.isnan(bias[:, 5, :6]).any()


# ---- a stop signal during the study after training -----------------------------------------------------

STOP_RUN = [
    "tokenizer=char",
    "pos=rope",
    "model.n_layer=1",
    "model.n_head=2",
    "model.n_embd=32",
    "model.block_size=64",
    "data.batch_size=8",
    "trainer.max_steps=6",
    "trainer.val_check_interval=6",
    "trainer.limit_val_batches=2",
    "callbacks.sample_generation.max_new_tokens=2",
    "logger=csv",
    "eval_length.enabled=true",
    "eval_length.factors=[1,2,4]",
    "eval_length.max_tokens=1025",
    "eval_length.rope_scalings=[ntk]",
    "eval_length.passkey.trials=2",
    "eval_length.passkey.depths=2",
]


def stop_during_study(args: list[str], cwd, hold: str, signum: int) -> tuple[int, str]:
    """Run ``python train.py <args>`` through tests/faults.py, which holds the length study after training
    (``hold_eval_length:<hold>``), and send ``signum`` once the process says the study is under way: (exit
    status, output)."""
    ready = ("length study under way", "passkey study under way")
    return signal_when_held(
        args, cwd, f"hold_eval_length:{hold}", ready, signum, env={"OMP_NUM_THREADS": "1"}
    )


def study_figures(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k.startswith(("length/", "passkey/"))}


@pytest.mark.slow
def test_sigterm_during_the_length_study_keeps_the_run_and_records_the_missing_figures(tmp_path):
    """SIGTERM at the length study's second measurement (1x finished, 2x under way): the run exits with status
    0, the checkpoint of its last step kept, result.json written with training's figures and the study's
    finished one, the part stopped and every missing figure named (as null), no length.json; the message's
    two ways to the missing figures, the script and resume=auto, give them, resume=auto into result.json."""
    run_dir = tmp_path / "run"
    args = [*STOP_RUN, f"paths.root_dir={tmp_path}", f"hydra.run.dir={run_dir}"]
    status, output = stop_during_study(args, tmp_path, "2", signal.SIGTERM)
    assert status == 0, output[-3000:]
    assert "Traceback" not in output
    assert (
        "Stopped by SIGTERM during the length study (eval_length), after training to step 6: the trained model "
        f"is kept ({run_dir / 'checkpoints' / 'last.ckpt'}); result.json records the run as stopped" in output
    ), output[-3000:]
    script = f"python scripts/eval_length.py {run_dir} --factors 1 2 4 --max-tokens 1025 --rope-scalings ntk"
    assert f"Get them with: {script} --passkey-depths 2 --passkey-trials 2 --passkey-seed 0 (writes" in output
    assert f"rerun the same command with resume=auto or resume={run_dir} (no step is trained again" in output

    result = json.loads((run_dir / "result.json").read_text())
    saved = torch.load(last_checkpoint(run_dir), weights_only=False)
    assert result["stopped_by_signal"] is True and result["finished"] is False
    assert result["stopped_during"] == "eval_length" and result["stop_signal"] == "SIGTERM"
    assert result["global_step"] == result["checkpoint_step"] == saved["global_step"] == 6
    assert [p["status"] for p in result["parts"]] == ["stopped"]
    assert math.isfinite(result["metrics"]["val/loss"])
    figures = study_figures(result["metrics"])
    missing = result["eval_length_missing"]
    assert {k for k, v in figures.items() if v is None} == set(missing)
    # the 1x measurement finished before the signal; the 2x one under way is missing, as is the passkey study
    assert {k for k in figures if k not in missing} == {"length/loss@1x", "length/ppl@1x", "length/bpb@1x"}
    assert "length/loss@2x" in missing and "passkey/acc@4x" in missing
    assert not (run_dir / "eval_length" / "length.json").exists()
    assert not list(run_dir.glob("eval_length/.*tmp*"))
    # the comparison lists it as unfinished, saying where it stopped
    record = read_run_dir(run_dir)
    assert record.describe_status() == (
        "stopped by a signal during the study after training (eval_length), at step 6 of 6"
    )
    assert record.final_val_loss == pytest.approx(result["metrics"]["val/loss"])

    # the message's script: the figures of the study the run would have finished
    out = subprocess.run(
        [sys.executable, *shlex.split(script)[1:], "--passkey-depths", "2", "--passkey-trials", "2"],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    by_script = length.summary_metrics(json.loads((run_dir / "eval_length" / "length.json").read_text()))
    by_script.update(json.loads((run_dir / "eval_length" / "passkey.json").read_text())["metrics"])

    # resume=auto: no step trained again, the study run whole; every missing figure filled, no other one
    resumed_out = run_train([*args, "resume=auto"], cwd=tmp_path, env={"OMP_NUM_THREADS": "1"})
    assert "Nothing left to train at step 6" in resumed_out.stdout
    resumed = json.loads((run_dir / "result.json").read_text())
    assert resumed["finished"] is True and resumed["stopped_by_signal"] is False
    assert "eval_length_missing" not in resumed and "stopped_during" not in resumed
    assert [p["status"] for p in resumed["parts"]] == ["stopped", "finished"]
    now = study_figures(resumed["metrics"])
    assert set(now) == set(figures) and all(math.isfinite(v) for v in now.values())
    assert now["length/loss@1x"] == pytest.approx(figures["length/loss@1x"], rel=1e-6)
    assert set(by_script) == set(now)
    for k, v in now.items():
        assert by_script[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k


@pytest.mark.slow
def test_ctrl_c_during_the_passkey_study_stops_the_sweep_with_the_length_figures_kept(tmp_path):
    """Ctrl-C as the passkey study begins in the first job of a two-job sweep: the sweep stops with status
    130, the second job never starts; the job's result.json keeps the length study's figures (and its
    length.json, whole), and names the passkey figures as missing."""
    sweep = tmp_path / "sweep"
    args = ["-m", *STOP_RUN, f"paths.root_dir={tmp_path}", "seed=0,1", f"hydra.sweep.dir={sweep}"]
    status, output = stop_during_study(args, tmp_path, "passkey", signal.SIGINT)
    run_dir = sweep / "0"
    assert status == 128 + signal.SIGINT, output[-3000:]
    assert "Traceback" not in output
    assert (
        "Stopped by Ctrl-C during the passkey study (eval_length.passkey), after training to step 6" in output
    )
    assert "continue the sweep with the command below" in output
    assert "Ctrl-C stopped the sweep in job #0 (" in output and not (sweep / "1").exists()

    result = json.loads((run_dir / "result.json").read_text())
    assert result["stopped_during"] == "eval_length.passkey" and result["stop_signal"] == "Ctrl-C"
    assert result["finished"] is False and result["stopped_by_signal"] is True
    figures = study_figures(result["metrics"])
    missing = result["eval_length_missing"]
    assert missing and all(k.startswith("passkey/") for k in missing)
    assert {k for k, v in figures.items() if v is None} == set(missing)
    whole = length.summary_metrics(json.loads((run_dir / "eval_length" / "length.json").read_text()))
    assert whole == {k: v for k, v in figures.items() if k not in missing}
    assert len(whole) == 3 * 5  # rope at 1x, 2x, 4x and rope+ntk at 2x, 4x: loss, ppl, bpb
    assert not (run_dir / "eval_length" / "passkey.json").exists()


def test_a_stop_signal_while_length_json_is_written_lets_it_be_written_whole(tmp_path, make_cfg, monkeypatch):
    """SIGTERM as the length study's files are written (the run in this process): length.json is written
    whole, the passkey study does not start, result.json records the stop there with the passkey figures
    missing, and the signal handlers are put back."""
    from gptlab.tasks.gpt import run

    write = length.write_outputs

    def write_under_a_signal(result, out_dir):
        os.kill(os.getpid(), signal.SIGTERM)  # handled before the file is written
        return write(result, out_dir)

    monkeypatch.setattr(length, "write_outputs", write_under_a_signal)
    handler_before = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        metrics = run(make_cfg(*STOP_RUN, f"paths.output_dir={out}"))
    finally:
        torch.set_num_threads(threads)
    assert signal.getsignal(signal.SIGTERM) == handler_before
    result = json.loads((out / "result.json").read_text())
    assert result["stopped_during"] == "eval_length.passkey" and result["stop_signal"] == "SIGTERM"
    assert result["finished"] is False and result["eval_length_missing"]
    assert all(k.startswith("passkey/") and math.isnan(metrics[k]) for k in result["eval_length_missing"])
    whole = length.summary_metrics(json.loads((out / "eval_length" / "length.json").read_text()))
    assert len(whole) == 3 * 5 and all(result["metrics"][k] == v for k, v in whole.items())
    assert not (out / "eval_length" / "passkey.json").exists()
