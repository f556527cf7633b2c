"""Downstream evaluation during training (``eval_harness``): the shipped harness tasks every N steps on the
model being trained, in metrics.csv and W&B at the steps of the validations, the last values in result.json
and in the comparison table; the training itself untouched by it; bad options refused at config time."""

import csv
import json
import random

import numpy as np
import pytest
import torch
from conftest import ROOT, TINY, run_train

pytest.importorskip("lm_eval")

from gptlab.comparison.report import compare  # noqa: E402
from gptlab.config import parse_gpt  # noqa: E402
from gptlab.errors import ConfigError  # noqa: E402
from gptlab.tracking.wandb_runs import find_runs, read_run  # noqa: E402

EVAL_RUN = [
    *TINY,
    "tokenizer=char",
    "trainer.max_steps=12",
    "trainer.val_check_interval=5",
    "trainer.log_every_n_steps=2",
    "logger=all",
    "eval_harness.enabled=true",
    "eval_harness.every_n_steps=5",
    "eval_harness.limit=4",
    "logger.wandb.group=downstream_test",
]
TASKS = ("gptlab_python_mc", "gptlab_python_text")


def train(make_cfg, root, name, *overrides):
    from gptlab.tasks.gpt import run

    cfg = make_cfg(*EVAL_RUN, *overrides, f"paths.output_dir={root / 'sweep' / name}", root=root)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run(cfg)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two runs with the evaluation on, seeds 0 and 1, in one folder as a sweep leaves them."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    root = tmp_path_factory.mktemp("downstream")

    def make_cfg(*overrides, root):
        GlobalHydra.instance().clear()
        with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
            return compose("train", overrides=[f"paths.root_dir={root}", *overrides])

    for seed in (0, 1):
        train(make_cfg, root, f"seed{seed}", f"seed={seed}")
    return root / "sweep"


def csv_rows(run_dir):
    with open(run_dir / "csv" / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_every_n_steps_and_the_last_step_are_logged_with_the_validations(two_runs):
    run_dir = two_runs / "seed0"
    rows = csv_rows(run_dir)
    names = {k for k in rows[0] if k.startswith("eval/")}
    assert names == {
        "eval/gptlab_python_mc/acc",
        "eval/gptlab_python_mc/acc_norm",
        "eval/gptlab_python_text/bits_per_byte",
        "eval/gptlab_python_text/byte_perplexity",
        "eval/gptlab_python_text/word_perplexity",
    }
    eval_steps = [int(r["step"]) for r in rows if r["eval/gptlab_python_text/bits_per_byte"]]
    val_steps = [int(r["step"]) for r in rows if r["val/loss"]]
    # steps 5 and 10 (every_n_steps) and 12 (the last): the weights that val/loss is logged for
    assert len(eval_steps) == 3 and eval_steps == val_steps
    for row in rows:
        if row["eval/gptlab_python_mc/acc"]:
            acc = float(row["eval/gptlab_python_mc/acc"])
            assert acc * 4 == round(acc * 4)  # a share of the 4 questions (limit=4)
            assert 0 < float(row["eval/gptlab_python_text/bits_per_byte"]) < 20
    # and the same values in the run's W&B file, at the same steps
    wandb_run = read_run(find_runs(run_dir)[0])
    logged = wandb_run.metric("eval/gptlab_python_text/bits_per_byte")
    assert [v for _, v in logged] == pytest.approx(
        [
            float(r["eval/gptlab_python_text/bits_per_byte"])
            for r in rows
            if r["eval/gptlab_python_text/bits_per_byte"]
        ]
    )


def test_result_json_holds_the_last_evaluation_and_the_table_shows_it(two_runs):
    finals = {}
    for name in ("seed0", "seed1"):
        run_dir = two_runs / name
        last = [r for r in csv_rows(run_dir) if r["eval/gptlab_python_mc/acc"]][-1]
        metrics = json.loads((run_dir / "result.json").read_text())["metrics"]
        for key in ("eval/gptlab_python_mc/acc", "eval/gptlab_python_text/bits_per_byte"):
            assert metrics[key] == float(last[key])  # exactly: the value logged, not a float32 copy
        finals[name] = metrics["eval/gptlab_python_text/bits_per_byte"]
    result = compare(two_runs, two_runs / "report")
    header = [line for line in result.table.splitlines() if line.startswith("| #")][0]
    assert "eval/gptlab_python_text/bits_per_byte" in header and "eval/gptlab_python_mc/acc" in header
    (row,) = result.rows  # one condition, two seeds
    mean = sum(finals.values()) / 2
    assert row.outputs["eval_harness"]["eval/gptlab_python_text/bits_per_byte"] == pytest.approx(mean)
    assert f"{mean:.4g}" in result.table


def test_an_evaluation_leaves_the_training_state_as_it_was(make_cfg):
    """Each module's train mode and every random generator the harness seeds are restored: a run trains the same with
    the evaluation on or off."""
    from gptlab.api import build_model, build_tokenizer
    from gptlab.evaluation.downstream import DownstreamEvalOptions
    from gptlab.training.downstream_eval import DownstreamEvaluation

    cfg = make_cfg(*EVAL_RUN)
    tokenizer = build_tokenizer(cfg)
    model = build_model(cfg, tokenizer)
    module = torch.nn.Module()
    module.model, module.tokenizer = model, tokenizer
    module.device = torch.device("cpu")
    model.train()
    model.lm_head.eval()  # a module the user keeps in eval mode stays so
    modes = [m.training for m in model.modules()]
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    before = (random.random(), np.random.rand(), torch.rand(1))
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    callback = DownstreamEvaluation(DownstreamEvalOptions(tasks=["gptlab_python_mc"], limit=2), 32)
    metrics = callback.evaluate(module)
    assert set(metrics) == {"eval/gptlab_python_mc/acc", "eval/gptlab_python_mc/acc_norm"}
    assert [m.training for m in model.modules()] == modes and model.training and not model.lm_head.training
    assert (random.random(), np.random.rand(), torch.rand(1)) == before


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "eval_harness.tasks=[gptlab_python_mc,hellaswagg]",
            "eval_harness.tasks has ['hellaswagg'], which the harness does not know. Local tasks: "
            "gptlab_python_mc, gptlab_python_text",
        ),
        ("eval_harness.every_n_steps=0", "eval_harness.every_n_steps=0 must be a positive integer."),
        ("eval_harness.limit=0", "eval_harness.limit=0 must be a positive integer (examples per task)"),
        ("eval_harness.include_path=[/no/such/folder]", "eval_harness.include_path has ['/no/such/folder']"),
        ("eval_harness.tasks=[]", "eval_harness.tasks=[] must be a non-empty list of task names"),
    ],
)
def test_bad_options_are_refused_at_config_time(make_cfg, override, message):
    with pytest.raises(ConfigError) as e:
        parse_gpt(make_cfg("eval_harness.enabled=true", override))
    assert message in str(e.value)


def test_a_sharded_strategy_is_refused(make_cfg):
    cfg = make_cfg(
        "eval_harness.enabled=true", "strategy=fsdp", "trainer.accelerator=cpu", "trainer.devices=2"
    )
    with pytest.raises(ConfigError, match="shards the weights"):
        parse_gpt(cfg)


def test_off_by_default_and_a_local_folder_adds_tasks(make_cfg, tmp_path):
    assert parse_gpt(make_cfg()).downstream_eval is None
    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / "mine.jsonl").write_text('{"q": "A", "choices": ["b", "c"], "answer": 0}\n')
    (folder / "mine.yaml").write_text(
        f"task: my_task\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / 'mine.jsonl'}\n"
        'test_split: test\noutput_type: multiple_choice\ndoc_to_text: "{{q}}"\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc\n'
    )
    options = parse_gpt(
        make_cfg(
            "eval_harness.enabled=true",
            "eval_harness.tasks=[my_task,gptlab_python_text]",
            f"eval_harness.include_path=[{folder}]",
        )
    ).downstream_eval
    assert options is not None and options.tasks == ("my_task", "gptlab_python_text")


@pytest.mark.slow
def test_ddp_ranks_wait_for_rank_zero_and_finish(tmp_path):
    """Two DDP processes on CPU: rank 0 evaluates between steps while rank 1 waits at the next all-reduce;
    the run finishes (no rank hangs), and the evaluations are logged once each."""
    run_dir = tmp_path / "run"
    proc = run_train(
        [
            *EVAL_RUN[: EVAL_RUN.index("logger=all")],
            "trainer.max_steps=6",
            "trainer.val_check_interval=3",
            "logger=csv",
            "eval_harness.enabled=true",
            "eval_harness.every_n_steps=3",
            "eval_harness.limit=4",
            "strategy=ddp",
            "trainer.accelerator=cpu",
            "trainer.devices=2",
            f"paths.root_dir={tmp_path}",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
        env={"WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"},
        timeout=600,
    )
    assert (proc.stdout + proc.stderr).count("downstream evaluation (") == 2  # steps 3 and 6, on rank 0 alone
    rows = [r for r in csv_rows(run_dir) if r["eval/gptlab_python_mc/acc"]]
    assert len(rows) == 2
    metrics = json.loads((run_dir / "result.json").read_text())["metrics"]
    assert metrics["eval/gptlab_python_text/bits_per_byte"] == float(
        rows[-1]["eval/gptlab_python_text/bits_per_byte"]
    )


def test_a_task_of_lm_eval_itself_is_found_beside_the_local_ones():
    """A hub task (its data needs the network, not tried here) is accepted by name, and the index the
    callback evaluates with holds it as well as the shipped tasks."""
    from gptlab.evaluation.downstream import DownstreamEvalOptions, check_tasks

    manager = check_tasks(DownstreamEvalOptions(tasks=["gptlab_python_mc", "hellaswag"]))
    assert {"gptlab_python_mc", "hellaswag"} <= set(manager.all_tasks)
