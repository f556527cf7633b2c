"""Bits per byte: the bytes a token covers come from its tokenizer, the same text counts the same bytes under
char, word and gpt2, and every reported bpb is the summed nats over the summed bytes, in bits."""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gptlab.data import tokenizers
from gptlab.data.tokenizers import TokenBytes, bits_per_byte
from gptlab.evaluation import length
from gptlab.model.config import GPTConfig
from gptlab.model.gpt import GPT
from gptlab.training.module import GPTLitModule

# Non-ASCII characters of 2, 3 and 4 bytes; no brackets or quotes, so the word tokenizer gives the text back.
DOCS = ["naïve café — 東京. Zürich, 1€ per ß; ok?", "Ünïcödé 𝄞 clef: done!"]


def stream(tokenizer: tokenizers.Tokenizer, docs: list[str]) -> list[int]:
    """Documents as the corpus pipeline lays them out: each after an <|endoftext|>."""
    ids: list[int] = []
    for doc in docs:
        ids += [tokenizer.eot_id, *tokenizer.encode(doc)]
    return ids


def built(name: str) -> tokenizers.Tokenizer:
    return tokenizers.build(name, DOCS)


@pytest.mark.parametrize("name", ["char", "word", "gpt2"])
def test_a_text_counts_the_same_bytes_under_every_tokenizer(name):
    tokenizer = built(name)
    ids = torch.tensor(stream(tokenizer, DOCS))
    counted = TokenBytes.of(tokenizer).count(ids[:-1], ids[1:])
    assert int(counted) == sum(len(doc.encode("utf-8")) for doc in DOCS) == 78
    # windows cut anywhere count the same bytes between them: each target's separator is read from its input
    table = TokenBytes.of(tokenizer)
    for cut in (1, 5, 17):
        first = table.count(ids[:cut], ids[1 : cut + 1])
        assert int(first + table.count(ids[cut:-1], ids[cut + 1 :])) == 78


def test_the_word_tokenizer_counts_the_text_it_gives_back():
    """Its tokens drop the whitespace: a run of spaces or a line break counts as the one space decode puts
    back, and <|unk|> only its space (the word it replaced is not in the ids)."""
    word = tokenizers.build("word", ["a b, c"])
    ids = torch.tensor([word.eot_id, *word.encode("a  b\n\nc, zebra")])
    assert word.decode(ids[1:].tolist()) == "a b c, <|unk|>"
    assert (
        int(TokenBytes.of(word).count(ids[:-1], ids[1:])) == len("a b c,") + 1
    )  # the unknown word: its space alone


def test_an_unknown_character_counts_no_byte():
    """The character <|unk|> replaced is not in the ids: it counts 0, as <|endoftext|> does."""
    char = tokenizers.CharTokenizer(["a", "é"], unk=True)
    ids = char.encode("aéz")
    assert ids[-1] == char.unk_id
    lengths, separators = char.token_byte_lengths()
    assert (lengths, separators) == ([1, 2, 0, 0], [0, 0, 0, 0])


def test_gpt2_counts_a_character_split_across_tokens_once():
    gpt2 = built("gpt2")
    ids = gpt2.encode("𝄞")  # 4 bytes, more than one byte-level token
    assert len(ids) > 1
    lengths, _ = gpt2.token_byte_lengths()
    assert sum(lengths[i] for i in ids) == 4 and lengths[gpt2.eot_id] == 0


def test_bits_per_byte_is_the_summed_nats_over_the_bytes_in_bits():
    assert bits_per_byte(2.0 * 10, 16) == pytest.approx(2.0 * 10 / (16 * math.log(2)), rel=1e-15)
    assert math.isnan(bits_per_byte(1.0, 0))


def char_problem():
    torch.manual_seed(0)
    char = built("char")
    ids = torch.tensor(stream(char, DOCS * 3))
    block = 16
    n = (len(ids) - 1) // block
    x = torch.stack([ids[i * block : i * block + block] for i in range(n)])
    y = torch.stack([ids[i * block + 1 : i * block + block + 1] for i in range(n)])
    return char, x, y


def test_a_char_runs_val_bpb_is_nats_per_character_over_ln2_times_characters_per_byte(tmp_path):
    import lightning as L

    char, x, y = char_problem()
    module = GPTLitModule(
        model=dict(vocab_size=char.vocab_size, block_size=16, n_layer=1, n_head=2, n_embd=16),
        loss={"impl": "chunked", "chunk_rows": 5},
        tokenizer=char,
    )
    loader = torch.utils.data.DataLoader(
        list(zip(x, y, strict=True)), batch_size=3
    )  # batches of unequal size
    trainer = L.Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    (logged,) = trainer.validate(module, loader, verbose=False)
    # directly: every target is one character; <|endoftext|> covers none
    with torch.no_grad():
        logits, _ = module.model(x)
    nats = F.cross_entropy(logits.flatten(0, 1).double(), y.flatten(), reduction="sum").item()
    text = "".join(char.decode([int(i)]) for i in y.flatten() if i != char.eot_id)
    characters, n_bytes = y.numel(), len(text.encode("utf-8"))
    assert n_bytes > len(text)  # the text has multi-byte characters
    assert logged["val/loss"] == pytest.approx(nats / characters, rel=1e-5)
    expected = (nats / characters) / math.log(2) * characters / n_bytes
    assert logged["val/bpb"] == pytest.approx(expected, rel=1e-5)


def test_the_length_study_reports_bpb_from_summed_nats_and_bytes():
    char, _, _ = char_problem()
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(vocab_size=char.vocab_size, block_size=8, n_layer=1, n_head=2, n_embd=16, pos="rope")
    )
    tokens = np.array(stream(char, DOCS * 4), dtype=np.uint16)
    result = length.evaluate_lengths(model, tokens, 8, length.LengthEvalOptions(factors=[1, 2]), char)
    for factor, entry in result["variants"]["rope"].items():
        scored = tokens[1 : entry["tokens"] + 1]
        text = "".join(char.decode([int(i)]) for i in scored if i != char.eot_id)
        assert entry["bytes"] == len(text.encode("utf-8"))
        assert entry["bpb"] == pytest.approx(entry["loss"] * entry["tokens"] / (entry["bytes"] * math.log(2)))
        assert length.summary_metrics(result)[f"length/bpb@{factor}x"] == entry["bpb"]
    assert "bpb" in length.format_table(result)


# ---- the comparison: ranked by bits per byte across tokenizers ---------------------------------------------


def record(tmp_path, tokenizer: str, seed: int, nats: float, bpb: float | None):
    from gptlab.comparison.records import RunRecord

    return RunRecord(
        path=tmp_path / f"{tokenizer}-{seed}",
        overrides={"tokenizer": tokenizer, "seed": str(seed)},
        val_loss=[(10, nats)],
        val_bpb=[(10, bpb)] if bpb is not None else [],
    )


def test_runs_of_different_tokenizers_are_ranked_by_bits_per_byte(tmp_path):
    from gptlab.comparison.table import condition_keys, markdown_table, ranking_metric, summarize

    # a character model has the lower nats (per character), GPT-2 the lower bits per byte
    runs = [
        record(tmp_path, "char", 0, 1.50, 2.20),
        record(tmp_path, "char", 1, 1.52, 2.23),
        record(tmp_path, "gpt2", 0, 4.10, 1.90),
        record(tmp_path, "gpt2", 1, 4.20, 1.95),
    ]
    keys = condition_keys(runs)
    assert keys == ["tokenizer"] and ranking_metric(runs) == "val/bpb"
    rows = summarize(runs, keys, metric="val/bpb")
    assert [r.choice["tokenizer"] for r in rows] == ["gpt2", "char"]
    assert rows[0].val_loss_mean == pytest.approx(1.925) and rows[1].final_losses == [2.20, 2.23]
    table = markdown_table(rows, keys)
    assert table.splitlines()[0].startswith("| # | tokenizer | seeds | val/bpb | Δ vs best (95% CI) |")
    assert "| 1 | gpt2 | 2 | 1.9250 ± 0.0354 |" in table
    # one tokenizer: nats per token, as before
    assert ranking_metric(runs[:2]) == "val/loss"


def test_runs_of_different_tokenizers_without_bits_per_byte_are_refused(tmp_path):
    from gptlab.comparison.table import ranking_metric
    from gptlab.errors import DataError

    runs = [record(tmp_path, "char", 0, 1.5, 2.2), record(tmp_path, "gpt2", 0, 4.1, None)]
    with pytest.raises(DataError, match=r"The runs differ in tokenizer, so they are ranked by bits per byte"):
        ranking_metric(runs)


@pytest.mark.slow
def test_a_sweep_over_two_tokenizers_is_ranked_by_bpb_in_compare_py(tmp_path, capsys):
    """`python train.py -m tokenizer=char,gpt2`, then `scripts/compare.py`: the table ranks by val/bpb, says
    so, and its figures are the runs' own."""
    import csv
    import runpy
    import sys

    from conftest import ROOT, SWEEP, run_train

    tiny = [a for a in SWEEP if not a.startswith(("tokenizer=", "pos=", "activation=", "seed=", "logger="))]
    sweep_dir = tmp_path / "multirun" / "tok"
    run_train(
        [
            "-m",
            *tiny,
            "logger=csv",
            "tokenizer=char,gpt2",
            f"paths.root_dir={tmp_path}",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        cwd=tmp_path,
    )
    argv = sys.argv
    sys.argv = ["compare.py", str(sweep_dir)]
    try:
        runpy.run_path(str(ROOT / "scripts" / "compare.py"), run_name="__main__")
    except SystemExit as e:
        assert e.code in (0, None)
    finally:
        sys.argv = argv
    printed = capsys.readouterr().out
    assert printed.startswith(
        "Ranked by final val/bpb (bits per byte): the runs differ in tokenizer, so nats per token are on "
        "different scales.\n| # | tokenizer | seeds | val/bpb |"
    )
    text = (sweep_dir / "comparison.md").read_text()
    assert "sorted by final validation bits per byte (`val/bpb`: the runs differ in tokenizer" in text
    assert "| # | tokenizer | seeds | val/bpb |" in text
    assert "Validation bits per byte at each multiple of the training context" in text
    finals = {}
    for job in sweep_dir.iterdir():
        metrics = next(job.glob("csv/**/metrics.csv"), None)
        if metrics is None:
            continue
        rows = [r for r in csv.DictReader(open(metrics)) if r.get("val/bpb")]
        tokenizer = "char" if "char" in (job / ".hydra" / "overrides.yaml").read_text() else "gpt2"
        finals[tokenizer] = float(rows[-1]["val/bpb"])
    ranked = [line.split("|")[2].strip() for line in text.splitlines() if line.startswith(("| 1 |", "| 2 |"))]
    assert ranked[:2] == sorted(finals, key=finals.get)
    best = ranked[0]
    assert f"| 1 | {best} | 1 | {finals[best]:.4f} |" in text
    # the length studies of the sweep, gathered by scripts/eval_length.py --sweep: in bits per byte too
    sys.argv = ["eval_length.py", "--sweep", str(sweep_dir)]
    try:
        runpy.run_path(str(ROOT / "scripts" / "eval_length.py"), run_name="__main__")
    except SystemExit as e:
        assert e.code in (0, None)
    finally:
        sys.argv = argv
    printed = capsys.readouterr().out
    assert printed.startswith("Validation bits per byte at each multiple of the training context:\n")
    summary = json.loads((sweep_dir / "length_summary.json").read_text())
    assert summary["metric"] == "bpb"
    for job in sweep_dir.iterdir():
        if (job / "eval_length" / "length.json").is_file():
            study = json.loads((job / "eval_length" / "length.json").read_text())
            bpb = study["variants"][study["pos"]]["1"]["bpb"]
            name = (
                "tokenizer=char"
                if "char" in (job / ".hydra" / "overrides.yaml").read_text()
                else "tokenizer=gpt2"
            )
            assert summary["table"][name]["1"]["mean"] == pytest.approx(bpb)
