"""Nothing lost and nothing silently wrong in the data: symbols a vocabulary lacks are kept as <|unk|>,
counted and refused above a threshold; a token cache damaged on disk is found when it is opened (real files
truncated and overwritten) and prepared again; token files a user brought are refused with the file and the
fix; a validation split without a window is refused before any step; an unwritable cache folder is named."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY
from test_errors import obey_file_permissions, permissions_apply
from test_token_files import write_llmc

from gptlab.data import corpus, tokenizers
from gptlab.data.corpus import DataSpec
from gptlab.data.shards import DamagedCache, read_index
from gptlab.data.tokenizers import UNK, CharTokenizer
from gptlab.errors import ConfigError, DataError
from gptlab.tasks.gpt import run

ENGLISH = "\n".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(400))
GREEK = "\n".join("Η γρήγορη καφέ αλεπού πηδά πάνω από τον τεμπέλη σκύλο." for _ in range(40))


# ---- unknown symbols ----------------------------------------------------------------------------------


def test_a_char_vocabulary_gains_unk_at_the_end_only_when_held_out_text_needs_it():
    tok = CharTokenizer.from_texts(["hello world"])
    assert tok.covering(["low hello"]) is tok  # nothing unseen: the same ids, size and fingerprint as ever
    assert tok.unk_id is None and tok.spec() == {"name": "char", "chars": tok.chars}
    wide = tok.covering(["hello wörld"])
    assert wide.vocab_size == tok.vocab_size + 1 and wide.unk_id == tok.vocab_size
    assert wide.eot_id == tok.eot_id and wide.ids == tok.ids  # every known id stays where it was
    ids = wide.encode("hello wörld")
    assert len(ids) == len("hello wörld") and ids.count(wide.unk_id) == 1  # kept, not dropped
    assert wide.decode(ids) == f"hello w{UNK}rld"
    again = tokenizers.from_spec(wide.spec())
    assert again.vocab_size == wide.vocab_size and again.encode("ö") == [wide.unk_id]


def book(tmp_path: Path, tail: str) -> str:
    """One long document: its last 10% is the validation split (English, then ``tail``)."""
    path = tmp_path / "book.txt"
    path.write_text(ENGLISH + "\n" + tail)
    return str(path)


def test_unseen_characters_are_counted_reported_and_refused_above_the_threshold(tmp_path, caplog):
    spec = DataSpec(path=book(tmp_path, GREEK), cache_dir=str(tmp_path / "c"))
    _, val_text = corpus.split_single_document(Path(spec.path).read_text(), spec.val_fraction)
    unseen = sum(1 for c in val_text if c not in set(ENGLISH + "\n"))
    share = unseen / len(val_text)
    assert 0.3 < share < 0.9
    with caplog.at_level(logging.WARNING), pytest.raises(ConfigError) as refused:
        corpus.prepare(spec, "char")
    message = str(refused.value)
    assert (
        f"The validation split of local files {spec.path!r} has {unseen} of its {len(val_text)} characters "
        in message
    )
    assert f"({100 * share:.3g}%) not seen in training, above tokenizer.max_unknown_fraction=0.01" in message
    assert "Train on text that covers it, use tokenizer=gpt2" in message
    assert "raise tokenizer.max_unknown_fraction (e.g. tokenizer.max_unknown_fraction=" in message
    assert f"validation: {unseen} characters ({100 * share:.3g}%) not seen in training" in caplog.text

    # accepted with a higher threshold, from the same cache: nothing was dropped, every unknown is <|unk|>
    prepared = corpus.prepare(spec, {"name": "char", "max_unknown_fraction": 0.9})
    tok, val = prepared.tokenizer, prepared.val.array()
    assert len(val) == len(val_text) + 1  # every character and <|endoftext|>
    assert int((val == tok.unk_id).sum()) == unseen == prepared.meta["splits"]["val"]["unknown"]
    assert prepared.meta["splits"]["val"]["symbols"] == len(val_text)
    cache = Path(prepared.val.shards[0].path).parent
    assert json.loads((cache / "meta.json").read_text())["splits"]["val"]["unknown"] == unseen


def test_a_char_vocabulary_that_covers_its_validation_text_has_no_unk(tmp_path, caplog):
    spec = DataSpec(path=book(tmp_path, "the end."), cache_dir=str(tmp_path / "c"))
    with caplog.at_level(logging.WARNING):
        prepared = corpus.prepare(spec, "char")
    assert prepared.tokenizer.unk_id is None and prepared.meta["splits"]["val"]["unknown"] == 0
    assert prepared.tokenizer.vocab_size == len(set(ENGLISH + "\n")) + 1
    assert "not seen in training" not in caplog.text


def test_unknowns_are_counted_in_what_a_capped_cache_keeps(tmp_path, monkeypatch):
    jsonl_corpus(tmp_path / "docs.jsonl", 2500)
    monkeypatch.setattr(corpus, "MIN_TASK_CHARS", 20_000)
    spec = DataSpec(path=str(tmp_path / "docs.jsonl"), cache_dir=str(tmp_path / "c"), max_tokens=30_000)
    prepared = corpus.prepare(spec, {"name": "word", "max_vocab": 8, "max_unknown_fraction": 1.0})
    unk, eot = prepared.tokenizer.unk_id, prepared.tokenizer.eot_id
    for split, tokens in (("train", prepared.train.array()), ("val", prepared.val.array())):
        facts = prepared.meta["splits"][split]
        assert facts["unknown"] == int((tokens == unk).sum()) > 0
        assert facts["symbols"] == int((tokens != eot).sum())
    share = prepared.meta["splits"]["train"]["unknown"] / prepared.meta["splits"]["train"]["symbols"]
    with pytest.raises(ConfigError) as refused:  # the default threshold, the same cache
        corpus.prepare(spec, {"name": "word", "max_vocab": 8})
    assert str(refused.value).startswith(
        f"The training split of local files {spec.path!r} has {prepared.meta['splits']['train']['unknown']} of "
        f"its {prepared.meta['splits']['train']['symbols']} words ({100 * share:.3g}%) outside the vocabulary, "
        "above tokenizer.max_unknown_fraction=0.1 of tokenizer=word: its loss would be on <|unk|> rather than on "
        "the text. Keep more words (tokenizer.max_vocab=8; null keeps every word of the training text), use "
        "tokenizer=gpt2"
    )


# ---- damaged caches -----------------------------------------------------------------------------------


def overwrite(path: Path, at: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(data)


def truncate_to(path: Path, fraction: float) -> None:
    os.truncate(path, int(path.stat().st_size * fraction))


DAMAGE = {
    "truncated shard": ("train_000001.bin", lambda p: truncate_to(p, 0.5), "bytes where index.json says"),
    "short val.bin": ("val.bin", lambda p: truncate_to(p, 0.3), "it was truncated"),
    "overwritten bytes": (
        "train_000000.bin",
        lambda p: overwrite(p, p.stat().st_size // 2, b"\xff\x7f" * 8),
        "does not have the CRC-32 index.json recorded",
    ),
    "truncated index.json": ("index.json", lambda p: truncate_to(p, 0.5), "cannot be read (JSONDecodeError"),
    "truncated meta.json": ("meta.json", lambda p: truncate_to(p, 0.5), "cannot be read (JSONDecodeError"),
    "missing shard": ("train_000002.bin", lambda p: p.unlink(), "is missing"),
    "missing meta.json": ("meta.json", lambda p: p.unlink(), "is missing"),
}


def jsonl_corpus(path: Path, n_docs: int) -> None:
    rng = np.random.default_rng(0)
    words = ENGLISH.split()
    with open(path, "w") as f:
        for i in range(n_docs):
            f.write(json.dumps({"text": f"Document {i}. " + " ".join(rng.choice(words, size=40))}) + "\n")


@pytest.fixture(scope="module")
def cache_template(tmp_path_factory):
    """A real cache of a small corpus in several training shards (one per Arrow record batch), prepared
    once, and its tokens."""
    root = tmp_path_factory.mktemp("corpus")
    jsonl_corpus(root / "docs.jsonl", 2500)
    spec = DataSpec(path=str(root / "docs.jsonl"), cache_dir=str(root / "cache"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(corpus, "MIN_TASK_CHARS", 20_000)
        prepared = corpus.prepare(spec, "gpt2")
    assert len(prepared.train.shards) >= 3
    return spec, Path(prepared.val.shards[0].path), prepared.train.array().copy(), prepared.val.array().copy()


@pytest.fixture
def small_cache(cache_template, tmp_path, monkeypatch):
    """A copy of the template cache in a folder of its own (its key is the same: the corpus is)."""
    spec, template_val, train, val = cache_template
    template = template_val.parent
    folder = tmp_path / "cache" / template.name
    shutil.copytree(template, folder)
    monkeypatch.setattr(corpus, "MIN_TASK_CHARS", 20_000)  # a rebuild makes the same shards
    return DataSpec(path=spec.path, cache_dir=str(tmp_path / "cache")), folder, train, val


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_cache_is_found_on_open_and_prepared_again(small_cache, damage, caplog):
    spec, folder, train, val = small_cache
    name, damage_file, problem = DAMAGE[damage]
    damage_file(folder / name)
    with caplog.at_level(logging.INFO):
        prepared = corpus.prepare(spec, "gpt2")
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"The token cache {folder} is damaged: {name} ")
    assert problem in warnings[0] and "Traceback" not in caplog.text
    assert warnings[0].endswith(
        ". Preparing it again from the corpus (nothing is lost: the cache is made from it)."
    )
    # nothing lost: the same tokens as before the damage, and a clean cache for the next run
    assert np.array_equal(prepared.train.array(), train) and np.array_equal(prepared.val.array(), val)
    read_index(folder)
    assert not list(folder.parent.glob("*.damaged-*"))


def test_checksums_beyond_the_budget_are_of_the_validation_split_only(small_cache):
    _, folder, _, _ = small_cache
    overwrite(folder / "train_000000.bin", 10, b"\xff\x7f" * 4)
    with pytest.raises(DamagedCache, match="train_000000.bin does not have the CRC-32"):
        read_index(folder)
    read_index(folder, verify_bytes=0)  # sizes only for the training shards: the cost of a huge cache
    overwrite(folder / "val.bin", 10, b"\xff\x7f" * 4)
    with pytest.raises(DamagedCache, match="val.bin does not have the CRC-32"):
        read_index(folder, verify_bytes=0)


def test_a_damaged_cache_that_cannot_be_removed_is_refused_with_the_command(small_cache, tmp_path):
    spec, folder, _, val = small_cache
    if not permissions_apply(tmp_path):
        pytest.skip("cannot make file permissions apply to a child process here")
    truncate_to(folder / "val.bin", 0.5)
    folder.parent.chmod(0o555)
    script = (
        "from gptlab.data import corpus; from gptlab.data.corpus import DataSpec; "
        f"corpus.MIN_TASK_CHARS = 20_000; corpus.prepare(DataSpec(path={spec.path!r}, cache_dir={spec.cache_dir!r}), 'gpt2')"
    )
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        preexec_fn=obey_file_permissions,
        timeout=300,
    )
    folder.parent.chmod(0o755)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"gptlab.errors.DataError: The token cache {folder} is damaged: val.bin has ")
    assert f"Delete the damaged cache as a user who may (`rm -r {folder}`) and run again" in last
    assert f"It cannot be prepared again here: {folder.parent} cannot be written (Permission denied)" in last
    assert np.array_equal(np.fromfile(folder / "val.bin", dtype=np.uint16), val[: len(val) // 2])  # untouched


# ---- token files a user brought, and validation before step 0 -----------------------------------------


def nanogpt(folder: Path, n_train: int, n_val: int) -> None:
    folder.mkdir()
    rng = np.random.default_rng(0)
    rng.integers(0, 50256, n_train, dtype=np.uint16).tofile(folder / "train.bin")
    rng.integers(0, 50256, n_val, dtype=np.uint16).tofile(folder / "val.bin")


def test_a_truncated_nanogpt_file_is_refused_with_the_file_and_the_fix(tmp_path):
    nanogpt(tmp_path / "d", 5000, 500)
    truncate_to(tmp_path / "d" / "val.bin", 0.5)
    with open(tmp_path / "d" / "val.bin", "ab") as f:
        f.write(b"\x01")  # an odd size: half a token
    with pytest.raises(DataError) as refused:
        corpus.prepare(DataSpec(path=str(tmp_path / "d")), "gpt2")
    message = str(refused.value)
    assert f"{tmp_path / 'd' / 'val.bin'} has 501 bytes, not a whole number of uint16 tokens" in message
    assert "Write it again with the preparation script that made it" in message


def test_a_missing_nanogpt_validation_file_is_named(tmp_path):
    nanogpt(tmp_path / "d", 5000, 500)
    (tmp_path / "d" / "val.bin").unlink()
    with pytest.raises(DataError) as refused:
        corpus.prepare(DataSpec(path=str(tmp_path / "d")), "gpt2")
    assert str(refused.value) == (
        f"data.path={str(tmp_path / 'd')!r} holds nanoGPT's train.bin but no val.bin: training needs both splits "
        f"(nanoGPT's prepare.py writes both). Write {tmp_path / 'd' / 'val.bin'} with the same script."
    )


def test_a_truncated_llmc_shard_is_refused_with_the_file_and_the_fix(tmp_path):
    (tmp_path / "d").mkdir()
    write_llmc(tmp_path / "d" / "x_train_000001.bin", np.arange(3000))
    write_llmc(tmp_path / "d" / "x_val_000000.bin", np.arange(300))
    truncate_to(tmp_path / "d" / "x_train_000001.bin", 0.8)
    size = (tmp_path / "d" / "x_train_000001.bin").stat().st_size
    with pytest.raises(DataError) as refused:
        corpus.prepare(DataSpec(path=str(tmp_path / "d")), "gpt2")
    assert str(refused.value) == (
        f"{tmp_path / 'd' / 'x_train_000001.bin'}: its header says 3000 tokens (7024 bytes) but the file has {size} "
        "bytes: the shard is truncated or was written by another tool. Write it again with the preparation "
        "script that made it, or move it out of the folder."
    )


def nothing_trained(out: Path) -> bool:
    return not (out / "checkpoints").exists() and not list(out.rglob("metrics.csv"))


def test_a_validation_split_without_a_window_is_refused_before_step_0(make_cfg, tmp_path):
    nanogpt(tmp_path / "d", 5000, 20)  # 20 validation tokens; a window of block_size + 1 = 33
    out = tmp_path / "run"
    cfg = make_cfg(
        *TINY, "logger=csv", "tokenizer=gpt2", f"data.path={tmp_path / 'd'}", f"paths.output_dir={out}"
    )
    with pytest.raises(DataError) as refused:
        run(cfg)
    assert str(refused.value) == (
        f"The validation tokens of data.path={str(tmp_path / 'd')!r} (val.bin) are 20, fewer than one window of "
        "model.block_size + 1 = 33: validation would measure nothing. Write the token files again with more "
        "validation text, or lower model.block_size (at most 19)."
    )
    assert nothing_trained(out)


# ---- a cache folder that cannot be written ----------------------------------------------------------


def in_child(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a Python child that meets file permissions (also when the tests run as root)."""
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        preexec_fn=obey_file_permissions,
        timeout=300,
    )


def test_a_read_only_empty_cache_folder_is_named_with_the_fix(tmp_path):
    # the same refusal through `python train.py` (exit status 2, no traceback) is docs/bad-input.md's case
    if not permissions_apply(tmp_path):
        pytest.skip("cannot make file permissions apply to a child process here")
    (tmp_path / "ro").mkdir(mode=0o555)
    cache_dir = tmp_path / "ro" / "tokens"
    proc = in_child(
        f"from gptlab.data import corpus; corpus.prepare(corpus.DataSpec(cache_dir={str(cache_dir)!r}), 'char')"
    )
    assert proc.stderr.strip().splitlines()[-1] == (
        f"gptlab.errors.DataError: The token cache folder {cache_dir} cannot be written (Permission denied): the "
        "tokens of embedded corpus 'pydoc_topics' are written there before training. Make it writable, or put the "
        "caches elsewhere with paths.cache_dir=<a writable folder> (or data.cache_dir=<folder> for the token "
        "caches alone)."
    )
    assert list((tmp_path / "ro").iterdir()) == []


@pytest.fixture
def small_disk(tmp_path):
    """A real filesystem with 64 KiB of room (a tmpfs), unmounted after the test."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here (needs root outside an unprivileged container): {mounted.stderr!r}"
        )
    yield disk
    subprocess.run(["umount", str(disk)], check=True)


@pytest.mark.parametrize("num_proc", [1, 2])
def test_a_disk_that_fills_while_tokens_are_written_is_named_with_the_fix_and_keeps_nothing(
    small_disk, tmp_path, num_proc
):
    # 2,000 documents of 40 to 120 words: about 230 kB of GPT-2 ids, on a disk with 64 KiB
    text = tmp_path / "corpus.jsonl"
    rng = np.random.default_rng(0)
    words = "the of and a to in is that for it as was with be by on not he this are or his".split()
    with open(text, "w") as f:
        for i in range(2000):
            f.write(
                json.dumps(
                    {"text": f"Document {i}. " + " ".join(rng.choice(words, int(rng.integers(40, 120))))}
                )
            )
            f.write("\n")
    cache_dir = small_disk / "tokens"
    spec = DataSpec(path=str(text), cache_dir=str(cache_dir), num_proc=num_proc)
    with pytest.raises(DataError) as refused:
        corpus.prepare(spec, "gpt2")
    message = str(refused.value)
    assert message.startswith(
        f"No space left on {cache_dir} while writing the token cache of local files '{text}': the disk filled "
        "after "
    ), message
    assert message.endswith(
        "Nothing was kept: the unfinished cache was removed. Free space there, or put the token caches on another "
        "disk with data.cache_dir=<a folder with room> (or paths.cache_dir=<folder> for every cache)."
    )
    # nothing is left but the lock file: neither a cache folder nor the unfinished one
    assert [p.suffix for p in cache_dir.iterdir()] == [".lock"]
    # the same corpus on a disk with room is prepared whole
    prepared = corpus.prepare(DataSpec(path=str(text), cache_dir=str(tmp_path / "tokens")), "gpt2")
    assert len(prepared.train) + len(prepared.val) > 64 * 1024 // 2
