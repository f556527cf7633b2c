"""The comparison of a sweep's runs, on run directories laid out as a Hydra multirun leaves them (overrides in
.hydra/, metrics written by Lightning's CSVLogger, length evaluations as length_eval.json), with metric values
chosen so that every figure of the table is known."""

import json
import math
import statistics
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from gptlab.errors import DataError
from gptlab.tracking.compare import compare, read_length_eval
from gptlab.tracking.loggers import csv_logger
from gptlab.tracking.naming import identity, is_sweep_value, swept_keys_of

# (pos, seed) -> final validation loss
FINAL = {("learned", 0): 3.0, ("learned", 1): 3.2, ("rope", 0): 2.5, ("rope", 1): 2.7, ("nope", 0): 3.9}


def make_run(
    job_dir: Path, pos: str, seed: int, final: float, length: dict | None = None, root: str = "/a"
) -> None:
    (job_dir / ".hydra").mkdir(parents=True)
    overrides = [f"pos={pos}", f"seed={seed}", "model.n_layer=2", f"paths.root_dir={root}"]
    OmegaConf.save(OmegaConf.create(overrides), job_dir / ".hydra" / "overrides.yaml")
    logger = csv_logger(str(job_dir))
    logger.log_metrics({"parameters/total": 1_500_000.0}, step=0)
    for step in range(10):
        logger.log_metrics(
            {"train/loss": 5.0 - step * 0.1, "train/tokens_per_second": 1000.0 + step, "train/mfu": 0.25},
            step=step,
        )
    for step, loss in ((4, final + 1.0), (9, final)):
        logger.log_metrics({"val/loss": loss, "val/ppl": math.exp(loss)}, step=step)
    logger.save()
    if length is not None:
        (job_dir / "length_eval.json").write_text(json.dumps(length))


def length_eval(ppl1: float, ppl2: float, ppl4: float | None) -> dict:
    results = [
        {"factor": 1, "context": 64, "loss": math.log(ppl1), "ppl": ppl1},
        {"factor": 2, "context": 128, "loss": math.log(ppl2), "ppl": ppl2},
    ]
    if ppl4 is None:
        results.append({"factor": 4, "context": 256, "loss": None, "ppl": None, "note": "table too short"})
    else:
        results.append({"factor": 4, "context": 256, "loss": math.log(ppl4), "ppl": ppl4})
    return {"train_context": 64, "results": results}


@pytest.fixture
def sweep_dir(tmp_path):
    lengths = {
        ("learned", 0): length_eval(20.0, 30.0, None),
        ("learned", 1): length_eval(22.0, 34.0, None),
        ("rope", 0): length_eval(12.0, 14.0, 40.0),
        ("rope", 1): length_eval(13.0, 16.0, 50.0),
    }
    for num, ((pos, seed), final) in enumerate(FINAL.items()):
        # paths.root_dir differs between runs but says nothing about the model: it must not split the rows
        make_run(tmp_path / str(num), pos, seed, final, lengths.get((pos, seed)), root=f"/r{num}")
    return tmp_path


def test_table_rows_are_choices_sorted_by_mean_final_loss(sweep_dir):
    result = compare(sweep_dir)
    assert result.keys == ["pos"]
    assert [r.choice["pos"] for r in result.rows] == ["rope", "learned", "nope"]
    assert [len(r.runs) for r in result.rows] == [2, 2, 1]
    rope, learned, nope = result.rows
    assert rope.val_loss_mean == pytest.approx(2.6)
    assert rope.val_loss_std == pytest.approx(statistics.stdev([2.5, 2.7]))
    assert nope.val_loss_std is None
    assert rope.val_ppl == pytest.approx((math.exp(2.5) + math.exp(2.7)) / 2)
    assert rope.parameters == 1_500_000 and rope.mfu == pytest.approx(0.25)
    assert rope.tokens_per_second == pytest.approx(1004.5)  # the median over the run
    assert [s for s, _ in rope.runs[0].val_loss] == [4, 9]

    lines = result.table.splitlines()
    assert lines[0] == (
        "| # | pos | seeds | val/loss | val/ppl | tokens/s | MFU | parameters | ppl@1x | ppl@2x | ppl@4x |"
    )
    assert lines[2].startswith("| 1 | rope | 2 | 2.6000 ± 0.1414 |")
    assert lines[2].endswith("| 1,004 | 25.0% | 1.50M | 12.50 | 15.00 | 45.00 |")
    assert lines[3].endswith("| 21.00 | 32.00 | n/a |")  # learned cannot run at 4x
    assert lines[4].startswith("| 3 | nope | 1 | 3.9000 |") and lines[4].endswith("| n/a | n/a | n/a |")
    assert result.table in result.markdown_path.read_text()
    assert result.plot_path.stat().st_size > 10_000


def test_runs_without_metrics_are_skipped_with_the_reason(sweep_dir):
    broken = sweep_dir / "9"
    (broken / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(["pos=alibi", "seed=0"]), broken / ".hydra" / "overrides.yaml")
    result = compare(sweep_dir, out_dir=sweep_dir / "report")
    assert [p.name for p, _ in result.skipped] == ["9"]
    assert "holds no metrics" in result.skipped[0][1]
    assert "alibi" not in result.table and (sweep_dir / "report" / "val_loss.png").is_file()


def test_a_folder_without_runs_is_refused_with_the_fix(tmp_path):
    with pytest.raises(DataError, match="none holds .hydra/overrides.yaml.*outputs/multirun"):
        compare(tmp_path)
    with pytest.raises(DataError, match="is not a directory"):
        compare(tmp_path / "missing")
    with pytest.raises(DataError, match="source='tensorboard' is not one of"):
        compare(tmp_path, source="tensorboard")


def test_length_eval_columns_follow_the_factors(tmp_path):
    data = length_eval(8.0, 9.5, None)
    data["results"].append({"factor": 8, "context": 512, "loss": 3.0})  # ppl left out: from the loss
    path = tmp_path / "length_eval.json"
    path.write_text(json.dumps(data))
    assert read_length_eval(path) == {
        "ppl@1x": 8.0,
        "ppl@2x": 9.5,
        "ppl@4x": None,
        "ppl@8x": pytest.approx(math.exp(3.0)),
    }


def test_names_groups_and_tags_come_from_the_overrides():
    overrides = ["pos=rope", "activation=swiglu", "seed=1", "paths.root_dir=/x", "optim.lr=0.0012345678"]
    swept = swept_keys_of(["pos=rope,alibi", "activation=swiglu", "seed=0,1,2", "optim.lr=0.0012345678"])
    assert swept == ["pos", "seed"]
    run = identity(overrides, multirun=True, sweep_dir="outputs/multirun/d/t", job_num=4, swept_keys=swept)
    assert run.name == "pos=rope seed=1"
    assert run.group == "outputs/multirun/d/t" and run.job_type == "sweep"
    assert run.tags == ["pos=rope", "activation=swiglu", "seed=1", "optim.lr=0.0012345678"]
    assert run.group_key == "pos=rope"
    # an experiment names its group; a search names runs by the searched values, short
    named = identity(["experiment=pos_sweep", *overrides], multirun=True, experiment="pos_sweep")
    assert named.group == "pos_sweep" and "lr=0.00123" in named.name
    searched = identity(overrides, multirun=True, swept_keys=["optim.lr"], searching=True)
    assert (
        searched.name == "lr=0.00123"
        and searched.job_type == "search"
        and searched.group_key == searched.tags[-1]
    )
    # a single run: no group, named by its choices
    single = identity(["pos=nope"])
    assert single.group is None and single.job_type == "train" and single.name == "pos=nope"
    assert is_sweep_value("range(1,4)") and is_sweep_value("a,b") and is_sweep_value("glob(*)")
    assert not is_sweep_value("0.5") and not is_sweep_value("[0.9,0.95]") and not is_sweep_value("'a,b'")
    assert swept_keys_of(["optim.betas=[0.9,0.95]", "seed=0,1"]) == ["seed"]


class ApiRunStandIn:
    """Stands in for wandb.apis.public.Run: the W&B API cannot be reached from the test machine. It has the
    attributes the comparison reads (config, summary, path, scan_history with the API's filtering: only rows
    holding every requested key)."""

    def __init__(self, pos: str, seed: int, losses: list[float]) -> None:
        self.config = {
            "pos": {"name": pos},
            "seed": seed,
            "sweep": {"overrides": [f"pos={pos}", f"seed={seed}"]},
        }
        self.summary = {"parameters/total": 2_000_000}
        self.path = ["me", "gptlab", f"{pos}{seed}"]
        self.rows = [{"trainer/global_step": 10 * (i + 1) - 1, "val/loss": v} for i, v in enumerate(losses)]
        self.rows.append({"trainer/global_step": 5, "train/tokens_per_second": 900.0})

    def scan_history(self, keys: list[str]):
        return [r for r in self.rows if all(k in r for k in keys)]


def test_online_runs_group_like_local_ones(tmp_path):
    from gptlab.tracking.compare import record_from_api_run, write_comparison

    records = [
        record_from_api_run(ApiRunStandIn("rope", 0, [3.0, 2.0])),
        record_from_api_run(ApiRunStandIn("rope", 1, [3.1, 2.2])),
        record_from_api_run(ApiRunStandIn("learned", 0, [3.2, 2.5])),
    ]
    result = write_comparison(records, tmp_path, "me/gptlab group")
    assert [(r.choice["pos"], len(r.runs)) for r in result.rows] == [("rope", 2), ("learned", 1)]
    assert result.rows[0].val_loss_mean == pytest.approx(2.1)
    assert result.rows[0].tokens_per_second == 900.0 and result.rows[0].parameters == 2_000_000
    assert records[0].val_loss == [(9, 3.0), (19, 2.0)]


def test_identity_from_a_composed_config():
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from gptlab import CONFIG_DIR
    from gptlab.tracking.naming import identity_from_hydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(
            "train", overrides=["pos=nope", "seed=3", "experiment=depth_sweep"], return_hydra_config=True
        )
    run = identity_from_hydra(cfg.hydra)
    assert run.name == "pos=nope seed=3" and run.group == "depth_sweep" and run.job_type == "train"
    assert run.tags == ["pos=nope", "seed=3", "experiment=depth_sweep"]
    assert identity_from_hydra().name is None  # no Hydra job running: W&B picks a name
