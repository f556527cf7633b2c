"""What a newcomer's first runs print beside the training itself: no notice about a setting they did not
write, no warning that does not apply to how gptlab trains."""

from __future__ import annotations

import csv
import json
import re
import sys
import warnings

import pytest
from conftest import ROOT, TINY, load_script

import gptlab


def test_a_short_epoch_logs_at_every_interval_without_lightnings_warning_or_notices(tmp_path, capfd):
    # 10 short documents: 6 training batches an epoch, fewer than the 8 steps of trainer.log_every_n_steps,
    # about which Lightning warns that the epoch logs nothing; it logs every 8 steps across epochs.
    corpus = tmp_path / "small.jsonl"
    line = "The quick brown fox jumps over the lazy dog, and then it rests in the sun for a while. "
    corpus.write_text("".join(json.dumps({"text": line}) + "\n" for _ in range(10)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = gptlab.train(
            *(o for o in TINY if not o.startswith("trainer.limit_val_batches=")),  # the default: every batch
            "tokenizer=char",
            "logger=[csv,tensorboard]",
            f"data.path={corpus}",
            "trainer.max_steps=16",
            "trainer.val_check_interval=16",
            "trainer.log_every_n_steps=8",
            f"paths.root_dir={tmp_path}",
            run_dir=tmp_path / "run",
        )
    assert result.finished and result.step == 16
    out, err = capfd.readouterr()
    shown = [str(w.message) for w in caught] + (out + err).splitlines()
    assert not [m for m in shown if "smaller than the logging interval" in m], shown
    assert not [m for m in shown if "limit_val_batches" in m], shown
    windows = re.search(r"Windows of 33 tokens: ([\d,]+) train", out)
    assert windows is not None and int(windows.group(1).replace(",", "")) // 4 < 8, (
        out
    )  # an epoch shorter than the interval
    with open(tmp_path / "run" / "csv" / "metrics.csv") as f:
        logged = [int(float(row["step"])) for row in csv.DictReader(f) if row.get("train/loss")]
    assert logged == [8, 16]  # every log_every_n_steps steps, across the epochs
    # the closing lines say where each logger wrote, TensorBoard included
    board = tmp_path / "run" / "tensorboard"
    assert f"\n  metrics: {tmp_path / 'run' / 'csv' / 'metrics.csv'}\n" in out
    assert f"\n  TensorBoard: {board}  (view: tensorboard --logdir {board})\n" in out
    assert list(board.glob("events.out.tfevents.*"))


@pytest.mark.parametrize(
    "script,argv,closest",
    [
        ("compare", ["--basline", "pos=learned"], "--baseline"),
        ("eval_length", ["run", "--facors", "1"], "--factors"),
        ("evaluate", ["run", "--log-smaples"], "--log-samples"),
        ("fit_scaling", ["--confidance", "0.9"], "--confidence"),
        ("model_card", ["--precison", "bf16-mixed"], "--precision"),
        ("plot_positions", ["--positons", "64"], "--positions"),
        ("eval_embeddings", ["--against-gensin"], "--against-gensim"),
        ("coord_check", ["--widhts", "64"], "--widths"),
        ("benchmark", ["model=small", "--roudns", "3"], "--rounds"),
    ],
)
def test_a_scripts_mistyped_flag_is_refused_with_the_closest_one(script, argv, closest, capsys):
    module = load_script(script)
    try:
        with pytest.raises(SystemExit) as ended:
            module.main(argv)
    finally:
        sys.modules.pop(script, None)
    err = capsys.readouterr().err
    assert ended.value.code == 2
    last = err.rstrip().splitlines()[-1]
    typo = next(arg for arg in argv if arg.startswith("--"))
    assert f": error: unrecognized arguments: {typo}" in last, err  # after the program name
    assert last.endswith(f". Did you mean {closest}?"), err


def test_the_model_card_names_the_closest_choice_and_key_as_train_py_does(capsys):
    module = load_script("model_card")
    try:
        assert module.main(["modle=small"]) == 2
        assert capsys.readouterr().err.rstrip().endswith("Did you mean model=small?")
        assert module.main(["pos=rop"]) == 2
        assert capsys.readouterr().err.rstrip().endswith("Did you mean pos=rope?")
    finally:
        sys.modules.pop("model_card", None)


def test_a_short_precision_reaches_lightning_by_its_full_name_without_its_warning(make_cfg, tmp_path):
    import lightning as L

    from gptlab.config import parse_gpt

    settings = parse_gpt(make_cfg("trainer.precision=bf16", "trainer.accelerator=cpu"))
    assert settings.trainer["precision"] == "bf16-mixed"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        L.Trainer(
            precision=settings.trainer["precision"],
            accelerator="cpu",
            logger=False,
            default_root_dir=tmp_path,
        )
    assert not [w for w in caught if "precision" in str(w.message)], [str(w.message) for w in caught]


@pytest.mark.parametrize("script", ["compare", "eval_length", "evaluate", "model_card", "benchmark"])
def test_a_scripts_usage_is_the_command_that_runs_it_and_its_errors_are_named_as_its_own(
    script, capsys, monkeypatch
):
    """``usage: python scripts/compare.py ...`` (the command to copy, as scripts/generate.py's), and argparse's
    refusals named as the script's own are (``compare: error: ...``)."""
    monkeypatch.setattr(sys, "argv", [str(ROOT / "scripts" / f"{script}.py")])
    module = load_script(script)
    try:
        with pytest.raises(SystemExit) as helped:
            module.main(["--help"])
        page = capsys.readouterr().out
        with pytest.raises(SystemExit) as ended:
            module.main(["--no-such-flag"])
    finally:
        sys.modules.pop(script, None)
    err = capsys.readouterr().err
    assert helped.value.code == 0 and page.startswith(f"usage: python scripts/{script}.py "), page
    assert ended.value.code == 2 and err.startswith(f"usage: python scripts/{script}.py "), err
    assert f"\n{script}: error: " in err, err
