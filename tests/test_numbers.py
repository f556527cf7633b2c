"""The numbers a run shows, each recomputed here by hand (torch, numpy, scipy) from the run's own weights and
data, and compared: the training loss of a step, the validation loss and bits per byte over which tokens, the
learning rate at each step, and what the final line says was left unscored."""

import copy
import csv
import json
import math

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import TINY, run_train
from torch.utils.data import DataLoader, TensorDataset

from gptlab.data.tokenizers import GPT2Tokenizer
from gptlab.tracking.loggers import csv_logger
from gptlab.training.module import GPTLitModule

# ---- the training loss of a step --------------------------------------------------------------------------


def test_an_accumulated_steps_train_loss_is_the_mean_over_its_micro_batches(tmp_path):
    # trainer.accumulate_grad_batches=2: one optimizer step over two micro-batches, whose gradient is that of
    # the mean of their two losses. The logged train/loss is that mean, not the last micro-batch's alone.
    torch.manual_seed(0)
    module = GPTLitModule(
        model=dict(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16),
        optim={"lr": 1e-2, "warmup_steps": 0},
        loss={"z_loss": 1e-3},
    )
    tokens = torch.randint(0, 64, (16, 9))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)  # in order
    weights = []  # the model before each optimizer step

    class Snapshot(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx % 2 == 0:
                weights.append(copy.deepcopy(pl_module.model))

    trainer = L.Trainer(
        max_steps=2, accumulate_grad_batches=2, callbacks=[Snapshot()], logger=csv_logger(str(tmp_path)),
        log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu",
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=loader)
    with open(tmp_path / "csv" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/loss")]
    assert [int(r["step"]) for r in rows] == [0, 1]  # one row per optimizer step
    for step, row in enumerate(rows):
        model = weights[step]
        cross_entropy, z_loss = [], []
        for micro in range(2):
            rows_of_batch = tokens[8 * step + 4 * micro : 8 * step + 4 * micro + 4]
            x, y = rows_of_batch[:, :-1], rows_of_batch[:, 1:]
            with torch.no_grad():
                logits, _ = model(x)
            logits = logits.double().flatten(0, 1)
            cross_entropy.append(F.cross_entropy(logits, y.flatten()).item())
            z_loss.append(1e-3 * (torch.logsumexp(logits, dim=-1) ** 2).mean().item())
        assert cross_entropy[0] != pytest.approx(cross_entropy[1], rel=1e-3)  # the mean differs from either
        assert float(row["train/loss"]) == pytest.approx(sum(cross_entropy) / 2, rel=1e-5)
        assert float(row["train/z_loss"]) == pytest.approx(sum(z_loss) / 2, rel=1e-4)


# ---- the validation loss over two processes ---------------------------------------------------------------


def gpt2_ids(n: int) -> np.ndarray:
    """``n`` real GPT-2 ids of the standard library's reference text, documents ended by <|endoftext|>."""
    from pydoc_data import topics

    tok = GPT2Tokenizer()
    ids: list[int] = []
    for key in sorted(topics.topics):
        ids += [*tok.encode(topics.topics[key]), tok.eot_id]
        if len(ids) >= n:
            return np.asarray(ids[:n], dtype=np.uint16)
    raise AssertionError("the corpus is shorter than asked")


@pytest.mark.slow
def test_two_processes_score_each_validation_window_once_and_say_what_was_not_scored(tmp_path):
    # Three validation windows of 32 on two ranks: Lightning's DistributedSampler gives rank 1 a copy of
    # window 0 so that both run two. The validation loss is over the three windows, each once: the mean over
    # their 96 targets, recomputed here from the final weights; the final line says which tokens were left out.
    block, tail = 32, 11
    data = tmp_path / "tokens"
    data.mkdir()
    ids = gpt2_ids(3000 + 3 * block + 1 + tail)
    ids[:3000].tofile(data / "train.bin")
    val = ids[3000:]
    val.tofile(data / "val.bin")
    run = tmp_path / "run"
    args = [
        *TINY, f"model.block_size={block}", "data.batch_size=2", "trainer.max_steps=2",
        "trainer.val_check_interval=2", "trainer.limit_val_batches=null", "tokenizer=gpt2",
        f"data.path={data}", "strategy=ddp", "trainer.accelerator=cpu", "trainer.devices=2",
        "callbacks.sample_generation.max_new_tokens=0", "logger=csv", f"hydra.run.dir={run}",
    ]  # fmt: skip
    proc = run_train(args, cwd=tmp_path)
    metrics = json.loads((run / "result.json").read_text())["metrics"]

    import gptlab

    model = gptlab.load_run(run, which="last").model.eval()
    windows = np.stack([val[i * block : i * block + block + 1] for i in range(3)]).astype(np.int64)
    x, y = torch.from_numpy(windows[:, :-1]), torch.from_numpy(windows[:, 1:])
    with torch.no_grad():
        logits, _ = model(x)
    nats = F.cross_entropy(logits.double().flatten(0, 1), y.flatten(), reduction="sum").item()
    assert metrics["val/tokens"] == 3 * block
    assert metrics["val/loss"] == pytest.approx(nats / (3 * block), rel=1e-5)
    # bits per byte: over the UTF-8 bytes of the text the 96 targets decode to (<|endoftext|> covers none)
    tok = GPT2Tokenizer()
    n_bytes = sum(len(tok.decode(row.tolist()).replace("<|endoftext|>", "").encode()) for row in y)
    assert metrics["val/bpb"] == pytest.approx(nats / (n_bytes * math.log(2)), rel=1e-5)
    line = next(line for line in proc.stdout.splitlines() if line.startswith("Final validation loss"))
    assert line.endswith(
        f"It scored 96 of the {len(val)} validation tokens, leaving out the first (nothing precedes it) and the "
        f"last {tail} (short of a window)"
    ), line
