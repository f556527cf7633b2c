"""Bad input is refused before any expensive work, with the bad value, what is allowed, and the fix.

One test per row of the README's "Bad input" table. Most go through `gptlab.tasks.gpt.run` in this process (the
whole task up to the point of failure) and check that nothing was started: no W&B run, no checkpoint. A few
go through `python train.py` to check the message a user reads and the exit status 2.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import CONF, TINY, run_train
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf

from gptlab.api import build_datamodule, build_model_config, build_tokenizer
from gptlab.errors import ConfigError, DataError
from gptlab.preflight import check_trainer_options
from gptlab.runs.layout import last_checkpoint
from gptlab.runs.resume import CheckpointError, checkpoint_to_resume, plan_resume
from gptlab.tasks.gpt import run

TEXT = (Path(__import__("pydoc_data.topics").topics.__file__)).read_text()[:40_000]


def run_in_process(make_cfg, out: Path, *overrides: str):
    """`gptlab.tasks.gpt.run` with TINY and a W&B logger; returns the run directory for inspection."""
    cfg = make_cfg(*TINY, "logger=wandb", f"paths.output_dir={out}", *overrides)
    run(cfg)


def nothing_started(out: Path) -> bool:
    return not (out / "wandb").exists() and not (out / "checkpoints").exists()


def choices(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


# ---- the config itself ---------------------------------------------------------------------------------


def test_unknown_group_choice_lists_the_choices(make_cfg):
    with pytest.raises(MissingConfigException) as e:
        make_cfg("pos=rotary")
    message = str(e.value)
    assert "Could not find 'pos/rotary'" in message
    assert all(f"\t{c}\n" in message + "\n" for c in choices("pos")), message


@pytest.mark.parametrize(
    "override,shown",
    [
        # the closest key, with the value typed, in place of Hydra's advice to add the typo with +
        ("optim.lrr=1e-3", "optim has no key 'lrr' (optim.lrr=1e-3). Its keys: optim.name, optim.lr, "),
        ("optim.lrr=1e-3", "Did you mean optim.lr=1e-3?"),
        ("model.n_layers=2", "Did you mean model.n_layer=2?"),
        ("trainer.max_step=5", "Did you mean trainer.max_steps=5?"),
        ("callbacks.progress_bar.refresh_rat=5", "Did you mean callbacks.progress_bar.refresh_rate=5?"),
        # a mistyped group at the top: the group
        ("modle=small", "The config has no key or group 'modle' (modle=small). Its keys: task, seed, "),
        ("modle=small", "Did you mean model=small?"),
        # a node's key typed at the top: the nested keys of that name (a + would add a key nothing reads)
        ("max_steps=100", "Its keys: task, seed, "),
        ("max_steps=100", "Did you mean trainer.max_steps=100 or word2vec.max_steps=100?"),
        # a Lightning Trainer argument that conf/trainer leaves out is suggested with its +
        ("trainer.max_epoch=3", "Did you mean +trainer.max_epochs=3? (trainer.max_epochs is a Lightning"),
        # nothing close: how to add a key the YAML leaves out
        ("optim.zzz=1", "A key the config leaves out is added with a leading +: +optim.zzz=1."),
        # the evaluation's interval keeps its name: no other node's spelling of a checkpoint interval is it
        ("eval_harness.checkpoint_every=5", "A key the config leaves out is added with a leading +:"),
    ],
)
def test_a_mistyped_key_gets_its_nodes_keys_and_the_closest_one(make_cfg, override, shown):
    from gptlab.cli import unknown_key

    with pytest.raises(ConfigCompositionException) as e:
        make_cfg(override)
    message = unknown_key(e.value)
    assert message is not None and shown in message, message
    assert "hydra" not in message.split("Its keys: ")[1].split(".")[0].split(", ")


# one case per entry of cli.SAME_SETTING_ELSEWHERE (the node's key it suggests, then the overrides that type
# another node's spelling under it), none of them close to the node's own spelling
SAME_SETTING_CASES = [
    ("checkpoint_every", ["word2vec.every_n_steps=100"], "Did you mean word2vec.checkpoint_every=100?"),
    (
        "every_n_train_steps",
        ["callbacks.last_checkpoint.checkpoint_every=20"],
        "Did you mean callbacks.last_checkpoint.every_n_train_steps=20?",
    ),
    ("dim", ["word2vec.n_embd=64"], "Did you mean word2vec.dim=64?"),
    ("n_embd", ["model.dim=64"], "Did you mean model.n_embd=64?"),
    (
        "cpu_offload",
        ["strategy=fsdp", "strategy.offload_parameters=true"],
        "Did you mean strategy.cpu_offload=true?",
    ),
    (
        "offload_optimizer",
        ["strategy=deepspeed_stage_2", "strategy.cpu_offload=true"],
        "Did you mean strategy.offload_optimizer=true or strategy.offload_parameters=true?",
    ),
    (
        "offload_parameters",
        ["strategy=deepspeed_stage_3", "strategy.cpu_offload=true"],
        "Did you mean strategy.offload_optimizer=true or strategy.offload_parameters=true?",
    ),
    ("lr", ["optim.learning_rate=1e-3"], "Did you mean optim.lr=1e-3?"),
]


@pytest.mark.parametrize("entry,overrides,shown", SAME_SETTING_CASES, ids=[c[0] for c in SAME_SETTING_CASES])
def test_a_key_spelled_as_another_node_spells_it_gets_this_nodes_spelling(make_cfg, entry, overrides, shown):
    """word2vec.every_n_steps=100 is nothing like any of word2vec's keys; it is how callbacks and the
    evaluation spell an interval: the refusal names word2vec's own key for the checkpoint interval."""
    from gptlab.cli import SAME_SETTING_ELSEWHERE, unknown_key

    with pytest.raises(ConfigCompositionException) as e:
        make_cfg(*overrides)
    message = unknown_key(e.value)
    node, typed = overrides[-1].split("=")[0].rsplit(".", 1)
    assert message is not None and message.endswith(f"{shown} ({node}'s name for that setting.)"), message
    assert typed in SAME_SETTING_ELSEWHERE[entry]


def test_every_entry_of_the_same_setting_table_has_its_case():
    from gptlab.cli import SAME_SETTING_ELSEWHERE

    assert sorted(c[0] for c in SAME_SETTING_CASES) == sorted(SAME_SETTING_ELSEWHERE)


@pytest.mark.parametrize(
    "override,shown",
    [
        # Hydra adds any +key at the top; no task reads it, so the run would train with the default
        ("+max_steps=3", "+max_steps=3 adds a top-level key that no part of gptlab reads"),
        ("+max_steps=3", "Did you mean trainer.max_steps=3 or word2vec.max_steps=3?"),
        ("+sed=7", "Did you mean seed=7?"),
        ("+notes=x", "Remove it; the top level takes: activation, activation_checkpointing,"),
    ],
)
def test_a_top_level_key_nothing_reads_is_refused_with_the_nested_key(make_cfg, override, shown):
    from gptlab.config import RunSettings

    with pytest.raises(ConfigError) as e:
        RunSettings.parse(make_cfg(override))
    assert shown in str(e.value), str(e.value)


def test_every_top_level_key_of_every_composition_is_read(make_cfg):
    from gptlab.config import RunSettings

    # the experiment, debug and search files write at the top level (@package _global_): none adds a key
    overrides = [f"experiment={p.stem}" for p in sorted((CONF / "experiment").glob("*.yaml"))]
    overrides += ["debug=fast", "hparams_search=optuna", "task=word2vec"]
    for override in overrides:
        RunSettings.parse(make_cfg(override))  # refuses a key outside the root config's


def test_override_typos_name_the_key_and_the_fix(make_cfg):
    with pytest.raises(
        ConfigError,
        match=r"trainer does not take option\(s\) trainer.max_epoch\..*Did you mean trainer.max_epochs\?",
    ):
        check_trainer_options(OmegaConf.to_container(make_cfg("+trainer.max_epoch=3").trainer))
    with pytest.raises(ConfigError, match=r"model.n_layers\..*Did you mean model.n_layer\?"):
        build_model_config(make_cfg("+model.n_layers=3"))
    with pytest.raises(
        ConfigError, match=r"data does not take option\(s\) data.batchsize\..*Did you mean data.batch_size\?"
    ):
        build_datamodule(make_cfg("+data.batchsize=4"))


@pytest.mark.parametrize(
    "override,message",
    [
        ("model.n_layer=abc", r"model.n_layer='abc' must be a positive integer"),
        (
            "trainer.max_steps=abc",
            r"trainer.max_steps='abc': set a positive integer number of optimizer steps",
        ),
        (
            "trainer.val_check_interval=often",
            r"trainer.val_check_interval='often' must be a positive integer",
        ),
        ("optim.lr=fast", r"optim.lr='fast' must be a number \(e.g. optim.lr=0.004\)"),
        ("data.batch_size=abc", r"data.batch_size='abc' must be an integer \(got str\)"),
        ("seed=abc", r"seed='abc' must be an integer"),
        ("seed=-1", r"seed=-1 must be from 0 to 4294967295 \(numpy's range; e.g. seed=1337\)\.$"),
        ("seed=4294967296", r"seed=4294967296 must be from 0 to 4294967295"),
        (
            "callbacks.last_checkpoint.background=sometimes",
            r"callbacks.last_checkpoint.background='sometimes' must be true \(write the checkpoints saved during "
            r"training in a thread",
        ),
    ],
)
def test_values_of_the_wrong_type(make_cfg, tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        run_in_process(make_cfg, tmp_path, override)
    assert nothing_started(tmp_path)


@pytest.mark.parametrize(
    "override,message",
    [
        ("model.block_size=0", "model.block_size=0 must be a positive integer (e.g. model.block_size=256)."),
        ("model.n_embd=-8", "model.n_embd=-8 must be a positive integer (e.g. model.n_embd=256)."),
        ("data.batch_size=0", "data.batch_size=0 must be a positive integer (e.g. data.batch_size=8)."),
        (
            "data.num_workers=-1",
            "data.num_workers=-1 must be 0 or a positive integer (e.g. data.num_workers=0).",
        ),
    ],
)
def test_a_size_out_of_range_is_refused_with_a_value_that_works(make_cfg, tmp_path, override, message):
    with pytest.raises(ConfigError) as refused:
        run_in_process(make_cfg, tmp_path, override)
    assert str(refused.value) == message
    assert nothing_started(tmp_path)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["trainer.val_check_interval=0.5"],
            "trainer.val_check_interval=0.5 is not a whole number of steps, and this run counts validation in "
            "optimizer steps (trainer.check_val_every_n_epoch=null), where Lightning refuses a fraction of an "
            "epoch: give a whole number of steps, e.g. trainer.val_check_interval=4 (0.5 x trainer.max_steps=8).",
        ),
        (
            ["trainer.val_check_interval=2.5", "trainer.check_val_every_n_epoch=1"],
            "trainer.val_check_interval=2.5: with trainer.check_val_every_n_epoch=1 a float is a fraction of an "
            "epoch and must be in (0, 1]",
        ),
    ],
)
def test_a_fractional_validation_interval_through_the_cli(tmp_path, overrides, message):
    proc = run_train(
        [*TINY, *overrides, "logger=wandb", f"paths.root_dir={tmp_path}", f"hydra.run.dir={tmp_path / 'r'}"],
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"gptlab: error: {message}" in proc.stderr and "Traceback" not in proc.stderr
    assert nothing_started(tmp_path / "r")


def test_a_fraction_of_an_epoch_validates_where_epochs_are_counted(make_cfg, tmp_path):
    # with trainer.check_val_every_n_epoch set, Lightning's fraction of an epoch is accepted (and 8 steps
    # are far less than half an epoch of the corpus: only the final validation runs)
    metrics = run(
        make_cfg(
            *TINY,
            "logger=none",
            "trainer.val_check_interval=0.5",
            "trainer.check_val_every_n_epoch=1",
            f"paths.output_dir={tmp_path}",
        )
    )
    assert metrics["val/loss"] > 0


@pytest.mark.parametrize("impl", ["liger", "cce"])
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_a_cuda_loss_kernel_on_a_cpu_machine_through_the_cli(tmp_path, impl):
    proc = run_train(
        [
            *TINY,
            f"loss.impl={impl}",
            "logger=wandb",
            f"paths.root_dir={tmp_path}",
            f"hydra.run.dir={tmp_path / 'r'}",
        ],
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (
        f"gptlab: error: loss.impl={impl} cannot run on cpu: it is a CUDA kernel (it needs a CUDA GPU and its "
        "package). Use loss.impl=auto (here: chunked), which gives the plain head's loss and gradients without "
        "holding the logits." in proc.stderr
    )
    assert "Traceback" not in proc.stderr
    # refused before the data, the loggers or the trainer: no W&B run, no token cache, no run files
    assert nothing_started(tmp_path / "r") and not list(tmp_path.glob("**/wandb"))
    assert not list(tmp_path.glob("**/*.bin")) and not (tmp_path / "r" / "config_resolved.yaml").exists()


# ---- the model -------------------------------------------------------------------------------------------


def test_n_embd_not_divisible_by_n_head(make_cfg):
    with pytest.raises(
        ConfigError, match=r"model.n_embd=128 is not divisible by model.n_head=3.*Choose n_head"
    ):
        build_model_config(make_cfg("model.n_head=3"))


@pytest.mark.skipif(not (CONF / "pos" / "rope.yaml").exists(), reason="pos=rope is not in this checkout")
def test_rope_refuses_an_odd_head_dimension(make_cfg):
    # 36 / 4 = 9 dimensions per head: RoPE rotates pairs of dimensions.
    with pytest.raises(ConfigError) as e:
        build_model_config(make_cfg("pos=rope", "model.n_embd=36", "model.n_head=4"))
    message = str(e.value)
    assert "9" in message and ("even" in message or "odd" in message), message


def test_n_head_not_divisible_by_n_kv_head(make_cfg):
    with pytest.raises(
        ConfigError, match=r"model.n_head=4 is not divisible by model.n_kv_head=3.*Use a divisor"
    ):
        build_model_config(make_cfg("model.n_kv_head=3"))


def test_context_longer_than_the_learned_position_table(make_cfg, tmp_path):
    with pytest.raises(ConfigError, match=r"data.block_size=64 is longer than the learned position table"):
        run_in_process(make_cfg, tmp_path, "data.block_size=64")
    assert nothing_started(tmp_path)


@pytest.mark.parametrize(
    ("overrides", "window", "context"),
    [
        (["attention=sliding_window"], 64, 32),  # the preset's window, sized for the default 128 positions
        (["attention=gemma2", "attention.window=32"], 32, 32),  # as long as the context: still no effect
        (
            ["attention.window=40", "model.block_size=64", "data.block_size=40"],
            40,
            40,
        ),  # the training context
    ],
)
def test_a_window_no_shorter_than_the_context_is_refused_before_the_data(
    make_cfg, tmp_path, overrides, window, context
):
    with pytest.raises(ConfigError) as refused:
        run_in_process(make_cfg, tmp_path, *overrides)
    message = str(refused.value)
    assert (
        f"attention.window={window} is not shorter than the training context of {context} positions"
        in message
    )
    assert f"Use attention.window below {context} (e.g. attention.window={context // 2})" in message
    assert nothing_started(tmp_path)


def test_a_window_shorter_than_the_context_trains(make_cfg):
    from gptlab.config import parse_gpt

    assert (
        parse_gpt(make_cfg(*TINY, "attention=sliding_window", "attention.window=31")).model.attention.window
        == 31
    )


@pytest.mark.parametrize(
    ("overrides", "shown"),
    [
        (
            ["pos=rope", "pos.scaling=yran"],
            "pos.scaling='yran' must be one of 'none', 'linear', 'ntk', 'yarn' "
            "(got str). Did you mean pos.scaling=yarn?",
        ),
        (
            ["optim.schedule=cosin"],
            "optim.schedule='cosin' must be one of cosine, wsd (e.g. "
            "optim.schedule=cosine). Did you mean optim.schedule=cosine?",
        ),
        (
            ["pos=rope", "pos.scaling=dynamic"],
            "pos.scaling='dynamic' must be one of 'none', 'linear', 'ntk', 'yarn' (got str).",
        ),  # nothing close: no guess
    ],
)
def test_a_mistyped_choice_of_an_option_gets_the_closest_one(make_cfg, overrides, shown):
    from gptlab.config import parse_gpt

    with pytest.raises(ConfigError) as refused:
        parse_gpt(make_cfg(*overrides))
    assert str(refused.value) == shown


def test_a_mistyped_task_gets_the_closest_one(make_cfg):
    from gptlab.tasks import task_runner

    with pytest.raises(ConfigError) as refused:
        task_runner(make_cfg("task=word2vc"))
    assert str(refused.value) == (
        "task='word2vc' is not one of gpt, word2vec: task=gpt trains the language model, task=word2vec word "
        "vectors. Did you mean task=word2vec?"
    )


def test_vocabulary_larger_than_the_models(make_cfg):
    cfg = make_cfg("model.vocab_size=1000")
    with pytest.raises(
        ConfigError, match=r"tokenizer=gpt2 has 50257 ids but model.vocab_size=1000.*Set model"
    ):
        build_model_config(cfg, build_tokenizer(cfg))


# ---- the data --------------------------------------------------------------------------------------------


def _missing(tmp_path: Path) -> Path:
    return tmp_path / "nothere.txt"


def _empty(tmp_path: Path) -> Path:
    (tmp_path / "empty.txt").write_text("")
    return tmp_path / "empty.txt"


def _latin1(tmp_path: Path) -> Path:
    (tmp_path / "latin.txt").write_bytes("caf\xe9 cr\xe8me br\xfbl\xe9e ".encode("latin-1") * 200)
    return tmp_path / "latin.txt"


def _broken_link(tmp_path: Path) -> Path:
    (tmp_path / "link.txt").symlink_to(tmp_path / "moved-away.txt")
    return tmp_path / "link.txt"


@pytest.mark.parametrize(
    "make_file,message",
    [
        (_missing, r"data.path='.*nothere.txt' matches no file"),
        (_empty, r"empty.txt' is empty"),
        (_latin1, r"is not UTF-8 text.*Convert it"),
        (_broken_link, r"link.txt' cannot be read \(No such file or directory\)"),
    ],
    ids=["missing", "empty", "not-utf8", "broken-link"],
)
def test_data_files_that_cannot_be_used(make_cfg, tmp_path, make_file, message):
    path = make_file(tmp_path)
    out = tmp_path / "run"
    with pytest.raises(DataError, match=message):
        run_in_process(make_cfg, out, f"data.path={path}")
    assert nothing_started(out)


def obey_file_permissions() -> None:
    """``preexec_fn`` for a child that must meet file permissions even when the tests run as root: it drops
    CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from the bounding set, so the program it runs has neither (the
    kernel then checks permission bits for it as for any user)."""
    if os.geteuid() != 0:
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pr_capbset_drop, cap_dac_override, cap_dac_read_search = 24, 1, 2
    for cap in (cap_dac_override, cap_dac_read_search):
        if libc.prctl(pr_capbset_drop, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def permissions_apply(tmp_path: Path) -> bool:
    probe = tmp_path / "probe"
    probe.write_text("x")
    probe.chmod(0)
    try:
        proc = subprocess.run(["cat", str(probe)], capture_output=True, preexec_fn=obey_file_permissions)
    except subprocess.SubprocessError:  # no CAP_SETPCAP to drop capabilities with
        return False
    finally:
        probe.unlink()
    return proc.returncode != 0


@pytest.mark.parametrize("what", ["data file", "output directory"])
def test_permission_denied_through_the_cli(tmp_path, what):
    if not permissions_apply(tmp_path):
        pytest.skip("cannot make file permissions apply to a child process here")
    if what == "data file":
        path = tmp_path / "secret.txt"
        path.write_text(TEXT)
        path.chmod(0)
        args = [f"data.path={path}", f"hydra.run.dir={tmp_path / 'run'}"]
        expected = (
            f"gptlab: error: Data file '{path}' cannot be read (Permission denied): fix its permissions"
        )
    else:
        (tmp_path / "locked").mkdir(mode=0o500)
        args = [f"hydra.run.dir={tmp_path / 'locked' / 'run'}"]
        expected = (
            f"gptlab: error: the output directory hydra.run.dir={tmp_path / 'locked' / 'run'} cannot be "
            f"created: {tmp_path / 'locked'} is not writable (permission denied). Choose a writable folder"
        )
    proc = run_train(
        [*TINY, f"paths.root_dir={tmp_path}", *args],
        cwd=tmp_path,
        check=False,
        preexec_fn=obey_file_permissions,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert expected in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "wandb").exists()


def test_corpus_shorter_than_one_window(make_cfg, tmp_path):
    for i in range(4):
        (tmp_path / f"{i}.txt").write_text(f"A short document, number {i}.")
    out = tmp_path / "run"
    with pytest.raises(DataError, match=r"fewer than one window of model.block_size \+ 1 = 33.*smaller"):
        run_in_process(make_cfg, out, f"data.path={tmp_path / '*.txt'}")
    assert nothing_started(out)


def test_validation_split_without_a_window(make_cfg, tmp_path):
    # One document: its last 0.1% (a few tokens) would be the validation split.
    (tmp_path / "book.txt").write_text(TEXT)
    out = tmp_path / "run"
    with pytest.raises(
        DataError, match=r"validation split .* fewer than one window of 33.*Raise data.val_fraction"
    ):
        run_in_process(make_cfg, out, f"data.path={tmp_path / 'book.txt'}", "data.val_fraction=0.001")
    assert nothing_started(out)


# ---- where it runs ----------------------------------------------------------------------------------------


def test_output_directory_that_cannot_be_written(make_cfg, tmp_path):
    (tmp_path / "a-file").write_text("not a folder")
    with pytest.raises(ConfigError, match=r"a-file/run cannot be written.*hydra.run.dir=<dir>"):
        run_in_process(make_cfg, tmp_path / "a-file" / "run")


def test_output_directory_that_cannot_be_written_through_the_cli(tmp_path):
    (tmp_path / "a-file").write_text("not a folder")
    proc = run_train([*TINY, f"hydra.run.dir={tmp_path / 'a-file' / 'run'}"], cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert "gptlab: error: the output directory hydra.run.dir=" in proc.stderr
    assert "a-file is a file, not a folder" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_gpu_accelerator_on_a_machine_without_one(make_cfg, tmp_path):
    with pytest.raises(ConfigError, match=r"trainer.accelerator=gpu but this machine has no CUDA GPU.*auto"):
        run_in_process(make_cfg, tmp_path, "trainer.accelerator=gpu")
    assert nothing_started(tmp_path)


@pytest.mark.parametrize(
    "override,message",
    [
        (
            "trainer.devices=0",
            r"trainer.devices=0 is not a number of devices\. Use a positive integer .* -1 or auto",
        ),
        ("trainer.devices=-2", r"trainer.devices=-2 is not a number of devices"),
        ("trainer.devices=1.5", r"trainer.devices=1.5 is not a number of devices"),
        ("trainer.devices=true", r"trainer.devices=True is not a number of devices"),
        ("trainer.devices=[0,0]", r"a list of distinct GPU indices"),
        ("trainer.num_nodes=0", r"trainer.num_nodes=0 must be a positive integer.*trainer.num_nodes=1"),
        ("trainer.num_nodes=1.5", r"trainer.num_nodes=1.5 must be a positive integer"),
        (
            "trainer.precision=bf17",
            r"trainer.precision='bf17' is not one of Lightning's precisions: 32-true, "
            r"bf16-mixed, .*Did you mean trainer.precision=bf16-mixed\?",  # the full name, not the short form
        ),
        (
            "trainer.accelerator=gpux",
            r"trainer.accelerator='gpux' is not one of auto, cpu, gpu, cuda, mps, tpu.*"
            r"Did you mean trainer.accelerator=gpu\?",
        ),
        ("trainer.accelerator=tpu", r"trainer.accelerator=tpu but this machine has no torch_xla"),
    ],
)
def test_trainer_arguments_lightning_would_refuse_only_after_the_data(make_cfg, tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        run_in_process(make_cfg, tmp_path, override)
    assert nothing_started(tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
@pytest.mark.parametrize(
    "override,message",
    [
        ("trainer.devices=-1", r"trainer.devices=-1 selects GPUs, but this run trains on the CPU"),
        ("trainer.devices=[0,1]", r"trainer.devices=\[0, 1\] selects GPUs, but this run trains on the CPU"),
        ("trainer.devices='0,1'", r"trainer.devices='0,1' selects GPUs.*trainer.devices=1"),
        # Lightning would train in bf16 instead, unasked
        (
            "trainer.precision=16-mixed",
            r"trainer.precision=16-mixed \(fp16 mixed precision\) does not run on "
            r"the CPU.*trainer.precision=32-true",
        ),
        ("trainer.precision=16", r"trainer.precision=16 \(fp16 mixed precision\)"),
        ("trainer.precision=transformer-engine", r"needs NVIDIA's transformer_engine package and a CUDA GPU"),
    ],
)
def test_gpu_only_trainer_arguments_on_a_machine_without_one(make_cfg, tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        run_in_process(make_cfg, tmp_path, override)
    assert nothing_started(tmp_path)


@pytest.mark.parametrize(
    "override", ["trainer.devices=auto", "trainer.devices='2'", "trainer.precision=bf16"]
)
def test_trainer_arguments_lightning_takes_pass(make_cfg, override):
    from gptlab.config import parse_trainer

    parse_trainer(make_cfg(override).trainer)


def test_more_gpus_than_the_machine_has_names_how_many_there_are():
    # the count is what torch.cuda.device_count() gives on a machine with 2 GPUs
    from gptlab.preflight import check_devices

    with pytest.raises(
        ConfigError, match=r"trainer.devices=3 but this machine has 2 GPU device\(s\)\. Use trainer.devices=2"
    ):
        check_devices(3, "cuda", 2)
    with pytest.raises(ConfigError, match=r"names GPU 2, but this machine has 2 GPU\(s\), numbered 0 to 1"):
        check_devices([0, 2], "gpu", 2)
    with pytest.raises(ConfigError, match=r"trainer.devices='1,3' names GPU 3"):
        check_devices("1,3", "auto", 2)
    for fine in (2, -1, "auto", [1], "0,1", "1"):
        check_devices(fine, "cuda", 2)


def test_the_precisions_are_lightnings():
    from typing import get_args

    from lightning.fabric.plugins.precision import precision

    from gptlab.preflight import PRECISIONS

    def flat(t) -> list:
        return [x for a in get_args(t) for x in (flat(a) if get_args(a) else [a])]

    assert sorted(map(str, PRECISIONS)) == sorted(map(str, flat(precision._PRECISION_INPUT)))


def test_devices_0_is_refused_through_the_cli_before_the_data(tmp_path):
    proc = run_train(
        ["trainer.devices=0", f"paths.root_dir={tmp_path}", f"hydra.run.dir={tmp_path / 'r'}"],
        cwd=tmp_path,
        check=False,
        timeout=300,
    )
    assert proc.returncode == 2
    assert "gptlab: error: trainer.devices=0 is not a number of devices" in proc.stderr
    assert "Traceback" not in proc.stderr and "MisconfigurationException" not in proc.stderr
    assert not (tmp_path / "outputs" / "cache").exists()  # no data was read


# strategy=deepspeed_stage_2 on a machine without CUDA, through the CLI: test_strategies.py,
# test_deepspeed_on_cpu_is_refused_before_any_work (exit status 2, the message, no token cache, no checkpoint).


# ---- checkpoints ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A real checkpoint: two steps of the TINY model on a small text file, trained in this process."""
    root = tmp_path_factory.mktemp("trained")
    (root / "corpus.txt").write_text(TEXT)
    args = [*TINY, "trainer.max_steps=2", "logger=none", f"data.path={root / 'corpus.txt'}"]
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose(
            "train", overrides=[*args, f"paths.root_dir={root}", f"paths.output_dir={root / 'run'}"]
        )
    run(cfg)
    return root, args, last_checkpoint(root / "run")


def test_checkpoint_from_a_different_architecture_through_the_cli(trained):
    root, args, ckpt = trained
    before = ckpt.stat().st_mtime_ns
    proc = run_train(
        [*args, "model.n_embd=64", f"resume={ckpt}", f"paths.root_dir={root}"], cwd=root, check=False
    )
    assert proc.returncode == 2
    err = proc.stderr
    assert (
        f"gptlab: error: Checkpoint {ckpt} is from a different model: model.n_embd: 32 in the checkpoint, 64 now"
        in err
    )
    assert "model.n_embd=32" in err and "Traceback" not in err
    assert ckpt.stat().st_mtime_ns == before  # nothing was trained or saved


def test_checkpoint_differences_are_all_listed(trained, make_cfg):
    root, args, ckpt = trained
    cfg = make_cfg(*TINY, "model.n_layer=2", "pos=sinusoidal")
    with pytest.raises(CheckpointError) as e:
        plan_resume(checkpoint_to_resume(str(ckpt), root), build_model_config(cfg))
    message = str(e.value)
    assert "model.n_layer: 1 in the checkpoint, 2 now" in message
    assert "pos: 'learned' in the checkpoint, 'sinusoidal' now" in message
    assert "pos.base" not in message  # sinusoidal's options are not learned's: the name says it all
    assert "(model.n_layer=1 pos=learned)" in message  # the overrides that resume it


@pytest.mark.parametrize("damage", ["truncated", "not-a-checkpoint", "missing"])
def test_unreadable_checkpoint_names_the_file(trained, make_cfg, tmp_path, damage):
    root, args, ckpt = trained
    bad = tmp_path / "last.ckpt"
    if damage == "truncated":
        shutil.copy(ckpt, bad)
        with open(bad, "r+b") as f:
            f.truncate(bad.stat().st_size // 2)
        message = rf"Checkpoint {bad} cannot be read .*truncated, corrupt"
    elif damage == "not-a-checkpoint":  # another file where a checkpoint goes: not told to delete it
        bad.write_text("hello")
        message = (
            rf"^Checkpoint {bad} cannot be read: it is not a PyTorch checkpoint \(it begins b'hello'; "
            r"torch.save's files begin with a zip archive's b'PK'\)\. Pass a run directory written by "
            r"`python train.py` \(outputs/runs/<date>/<time>\) or one of its checkpoints"
        )
    else:
        message = rf"resume={bad}: no such file or directory.*resume=auto"
    model_config = build_model_config(make_cfg(*TINY), build_tokenizer(make_cfg(*TINY)))
    with pytest.raises(CheckpointError, match=message):
        plan_resume(checkpoint_to_resume(str(bad), tmp_path), model_config)
