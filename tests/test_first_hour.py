"""What a newcomer's first runs print beside the training itself: no notice about a setting they did not
write, no warning that does not apply to how gptlab trains."""

from __future__ import annotations

import csv
import json
import re
import warnings

from conftest import TINY

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
            "logger=csv",
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
    windows = re.search(r"Windows of 33 tokens: (\d+) train", out)
    assert windows is not None and int(windows.group(1)) // 4 < 8, out  # an epoch shorter than the interval
    with open(tmp_path / "run" / "csv" / "metrics.csv") as f:
        logged = [int(float(row["step"])) for row in csv.DictReader(f) if row.get("train/loss")]
    assert logged == [8, 16]  # every log_every_n_steps steps, across the epochs
