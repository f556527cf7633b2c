"""Sharded token caches, nanoGPT's and llm.c's token files, and the atomic cache."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, TINY, run_train, signal_when_held

from gptlab.data import corpus
from gptlab.data.corpus import DataSpec
from gptlab.data.datamodule import GPTDataModule, TokenWindows
from gptlab.data.shards import LLMC_MAGIC, Shard, TokenShards
from gptlab.data.tokenizers import GPT2Tokenizer
from gptlab.errors import ConfigError, DataError


def write_llmc(path, tokens, magic=LLMC_MAGIC):
    """A shard as llm.c's preparation writes it: 256 int32 (magic, version, count), then uint16 tokens."""
    header = np.zeros(256, dtype=np.int32)
    header[:3] = magic, 1, len(tokens)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype=np.uint16).tobytes())


def gpt2_tokens(n_docs=60):
    """Real GPT-2 ids of real text, EOT after each document, as nanoGPT's prepare.py lays them out."""
    from pydoc_data import topics

    tok = GPT2Tokenizer()
    docs = [topics.topics[k] for k in sorted(topics.topics)][:n_docs]
    return np.concatenate([np.asarray(tok.encode(d) + [tok.eot_id], dtype=np.uint16) for d in docs])


@pytest.mark.parametrize("block,stride", [(9, 9), (9, 4), (16, 7), (40, 40)])
def test_windows_run_across_shard_boundaries_exactly_as_across_one_file(tmp_path, block, stride):
    tokens = (np.arange(500) * 7 % 50257).astype(np.uint16)
    tokens.tofile(tmp_path / "one.bin")
    one = TokenWindows(TokenShards([Shard(str(tmp_path / "one.bin"), 500)], np.uint16), block, stride)
    # four shards of uneven sizes, one with a 1 KiB header, one of a single token
    shards, start = [], 0
    for i, size in enumerate([123, 1, 200, 176]):
        path = tmp_path / f"s{i}.bin"
        if i == 2:
            write_llmc(path, tokens[start : start + size])
            shards.append(Shard(str(path), size, offset=1024))
        else:
            tokens[start : start + size].tofile(path)
            shards.append(Shard(str(path), size))
        start += size
    many = TokenWindows(TokenShards(shards, np.uint16), block, stride)
    assert len(many) == len(one) > 0
    for i in range(len(one)):
        assert [t.tolist() for t in many[i]] == [t.tolist() for t in one[i]]


def make_corpus(path, n_docs, words=120, seed=0):
    rng = np.random.default_rng(seed)
    vocab = "the of and a to in is that for it as was with be by on not he this are or his".split()
    with open(path, "w") as f:
        for i in range(n_docs):
            text = f"Document {i}. " + " ".join(rng.choice(vocab, size=int(rng.integers(20, words))))
            f.write(json.dumps({"text": text if i % 17 else "   "}) + "\n")  # some blank documents


def test_several_processes_write_shards_that_read_as_the_single_process_tokens(tmp_path, monkeypatch):
    make_corpus(tmp_path / "c.jsonl", 3000)
    one = corpus.prepare(DataSpec(path=str(tmp_path / "c.jsonl"), cache_dir=str(tmp_path / "a")), "gpt2")
    monkeypatch.setattr(corpus, "MIN_TASK_CHARS", 20_000)
    spec = DataSpec(path=str(tmp_path / "c.jsonl"), cache_dir=str(tmp_path / "b"), num_proc=2)
    many = corpus.prepare(spec, "gpt2")
    assert len(one.train.shards) == 1 and len(many.train.shards) > 2  # one per Arrow record batch here
    index = json.loads((Path(many.train.shards[0].path).parent / "index.json").read_text())
    assert [s["tokens"] for s in index["splits"]["train"]] == [s.n_tokens for s in many.train.shards]
    assert np.array_equal(many.train.array(), one.train.array())
    assert np.array_equal(many.val.array(), one.val.array())
    assert many.meta["splits"] == one.meta["splits"]
    assert many.unigram_entropy == pytest.approx(one.unigram_entropy)
    blank = 3000 // 17 + 1
    assert sum(s["documents"] for s in many.meta["splits"].values()) == 3000 - blank


def test_max_tokens_keeps_the_first_training_tokens(tmp_path, monkeypatch):
    make_corpus(tmp_path / "c.jsonl", 2000)
    monkeypatch.setattr(corpus, "MIN_TASK_CHARS", 20_000)
    full = corpus.prepare(DataSpec(path=str(tmp_path / "c.jsonl"), cache_dir=str(tmp_path / "c")), "gpt2")
    capped = corpus.prepare(
        DataSpec(path=str(tmp_path / "c.jsonl"), cache_dir=str(tmp_path / "c"), max_tokens=12_345), "gpt2"
    )
    assert len(capped.train) == 12_345 < len(full.train)
    assert np.array_equal(capped.train.array(), full.train.array()[:12_345])
    assert 0 < len(capped.val) < len(full.val)  # validation from the same documents


KILLED = """
import sys
from gptlab.data import corpus
corpus.MIN_TASK_CHARS = 50_000
corpus.prepare(corpus.DataSpec(path=sys.argv[1], cache_dir=sys.argv[2], num_proc=1), "gpt2")
"""


def test_a_killed_preparation_leaves_no_cache_and_the_next_one_starts_clean(tmp_path):
    make_corpus(tmp_path / "c.jsonl", 60_000, words=200)
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen([sys.executable, "-c", KILLED, str(tmp_path / "c.jsonl"), str(cache)], env=env)
    deadline = time.monotonic() + 240
    # kill it once it has written shards, mid-way
    while time.monotonic() < deadline and not list(cache.glob("*.tmp-*/train_000002.bin")):
        assert proc.poll() is None, "the preparation ended before it could be killed"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert [p.name for p in cache.iterdir() if p.is_dir() and ".tmp-" not in p.name] == []  # no cache folder
    assert len(list(cache.glob("*.tmp-*"))) == 1  # the dead one's work folder, with its shards

    prepared = corpus.prepare(DataSpec(path=str(tmp_path / "c.jsonl"), cache_dir=str(cache)), "gpt2")
    assert list(cache.glob("*.tmp-*")) == []  # removed: its writer is gone
    (folder,) = [p for p in cache.iterdir() if p.is_dir()]
    assert (folder / "meta.json").is_file()
    assert prepared.meta["splits"]["train"]["documents"] + prepared.meta["splits"]["val"]["documents"] == (
        60_000 - (60_000 // 17 + 1)
    )


@pytest.mark.slow
def test_ctrl_c_while_a_cache_is_prepared_says_so_leaves_nothing_half_made_and_the_same_command_recovers(
    tmp_path,
):
    args = [*TINY, "tokenizer=char", "trainer.max_steps=2", "trainer.val_check_interval=2", "logger=csv"]
    args.append(f"paths.root_dir={tmp_path}")
    # Ctrl-C once the preparation has made its work folder and is tokenizing (tests/faults.py holds it there)
    status, output = signal_when_held(
        args, tmp_path, "hold_tokenizing", ("tokenization under way",), signal.SIGINT
    )
    assert status == 128 + signal.SIGINT, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert (
        "gptlab: Ctrl-C stopped the run before its first training step: nothing was trained, and nothing was left "
        "half-written (a token cache is written whole or not at all; the checkpoints of a resumed run are as "
        "they were). The same command starts again."
    ) in output
    tokens = tmp_path / "outputs" / "cache" / "tokens"
    assert [p.name for p in tokens.iterdir() if p.is_dir()] == []  # neither a cache nor its work folder
    assert not (tmp_path / "outputs" / "runs").exists()  # the run folder it made, and its dated parents, went

    proc = run_train(args, cwd=tmp_path)  # the same command, as the message says
    assert "Final validation loss" in proc.stdout
    (cache,) = [p for p in tokens.iterdir() if p.is_dir()]
    assert json.loads((cache / "meta.json").read_text())["splits"]["train"]["tokens"] > 0


def test_work_folders_of_unfinished_preparations_on_any_host_are_removed_under_the_lock(tmp_path):
    """A preempted job requeued on another node finds the work folder its first try left on the shared cache
    folder: the preparation that takes the cache's lock removes it, whichever host made it and whatever process
    now has the id in its name (here pid 1, alive on this host), since no live preparation can own one then."""
    import socket

    make_corpus(tmp_path / "c.jsonl", 300)
    spec = DataSpec(path=str(tmp_path / "c.jsonl"), cache_dir=str(tmp_path / "cache"))
    corpus.prepare(spec, "gpt2")
    (cache,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    left = [
        cache.parent / f"{cache.name}.tmp-node17.cluster-4242",  # a dead job on another node
        cache.parent / f"{cache.name}.tmp-{socket.gethostname()}-1",  # its pid now another live process's
    ]
    for folder in left:
        folder.mkdir()
        (folder / "train_000000.bin").write_bytes(b"\0" * 4096)
    other = cache.parent / "pydoc-gpt2-0123456789abcdef.tmp-node17-4242"  # another cache's: not this lock's
    other.mkdir()
    shutil.rmtree(cache)  # the cache is prepared again

    prepared = corpus.prepare(spec, "gpt2")
    assert prepared.meta["splits"]["train"]["tokens"] > 0
    assert [p for p in left if p.exists()] == []
    assert other.is_dir()


@pytest.mark.slow
def test_sigterm_while_a_cache_is_prepared_says_so_and_removes_its_work_folder(tmp_path):
    """A scheduler's preemption during data preparation, the SIGTERM sent to every process of the job (the
    pool's tokenizing workers too): one line, no traceback, the work folder and the run folder gone, and the
    exit status 128 + 15 with which a shell reports a process SIGTERM ended."""
    make_corpus(tmp_path / "c.jsonl", 300)
    args = [
        *TINY,
        f"data.path={tmp_path / 'c.jsonl'}",
        "data.num_proc=2",
        "trainer.max_steps=2",
        "logger=csv",
    ]
    args.append(f"paths.root_dir={tmp_path}")
    status, output = signal_when_held(
        args, tmp_path, "hold_tokenizing", ("tokenization under way",), signal.SIGTERM, to_group=True
    )
    assert status == 128 + signal.SIGTERM, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert (
        "gptlab: SIGTERM stopped the run before its first training step: nothing was trained, and nothing was "
        "left half-written"
    ) in output
    tokens = tmp_path / "outputs" / "cache" / "tokens"
    assert [p.name for p in tokens.iterdir() if p.is_dir()] == []  # neither a cache nor its work folder
    assert not (tmp_path / "outputs" / "runs").exists()


# ---- the anchors' token files ---------------------------------------------------------------------------


def nanogpt_folder(path):
    tokens = gpt2_tokens()
    path.mkdir()
    cut = int(len(tokens) * 0.9)
    tokens[:cut].tofile(path / "train.bin")
    tokens[cut:].tofile(path / "val.bin")
    return tokens[:cut], tokens[cut:]


def llmc_folder(path):
    tokens = gpt2_tokens()
    path.mkdir()
    cut = int(len(tokens) * 0.9)
    write_llmc(path / "pydoc_val_000000.bin", tokens[cut:])
    write_llmc(path / "pydoc_train_000001.bin", tokens[: cut // 3])
    write_llmc(path / "pydoc_train_000002.bin", tokens[cut // 3 : cut])
    return tokens[:cut], tokens[cut:]


@pytest.mark.parametrize("layout", ["nanoGPT", "llm.c"])
def test_token_folders_are_read_as_they_are(tmp_path, layout):
    train, val = (nanogpt_folder if layout == "nanoGPT" else llmc_folder)(tmp_path / "d")
    dm = GPTDataModule(DataSpec(path=str(tmp_path / "d"), cache_dir=str(tmp_path / "c")), "gpt2", 64, 4)
    dm.setup("fit")
    assert dm.tokenizer.name == "gpt2" and not (tmp_path / "c").exists()  # nothing re-tokenized or cached
    assert np.array_equal(dm.corpus.train.array(), train) and np.array_equal(dm.corpus.val.array(), val)
    x, y = dm.train_set[len(dm.train_set) - 1]
    start = (len(dm.train_set) - 1) * 64
    assert (
        x.tolist() == train[start : start + 64].tolist()
        and y.tolist() == train[start + 1 : start + 65].tolist()
    )
    assert 4.0 < dm.corpus.unigram_entropy < 7.5


def test_a_wrong_magic_number_or_a_learned_vocabulary_is_refused(tmp_path):
    llmc_folder(tmp_path / "d")
    with pytest.raises(ConfigError, match="tokenizer=gpt2"):
        corpus.prepare(DataSpec(path=str(tmp_path / "d")), "word")
    write_llmc(tmp_path / "d" / "pydoc_train_000002.bin", [1, 2, 3], magic=20240801)
    with pytest.raises(DataError, match=r"pydoc_train_000002.bin is not an llm.c token shard: .*20240801"):
        corpus.prepare(DataSpec(path=str(tmp_path / "d")), "gpt2")
    (tmp_path / "e").mkdir()
    write_llmc(tmp_path / "e" / "x_train_000001.bin", [1, 2, 3])
    with pytest.raises(DataError, match=r"no \*_val_\*.bin"):
        corpus.prepare(DataSpec(path=str(tmp_path / "e")), "gpt2")


@pytest.mark.parametrize("layout", ["nanoGPT", "llm.c"])
def test_train_py_trains_on_the_token_folder(tmp_path, layout):
    _, val = (nanogpt_folder if layout == "nanoGPT" else llmc_folder)(tmp_path / "d")
    args = [*TINY, "trainer.max_steps=3", "logger=none", f"data.path={tmp_path / 'd'}", "tokenizer=gpt2"]
    # the length study after training reads the same validation tokens (llm.c's shards carry a header)
    args += ["eval_length.enabled=true", "eval_length.factors=[1,2]", "eval_length.passkey.enabled=false"]
    proc = run_train([*args, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert f"{layout} token files in {tmp_path / 'd'}" in proc.stdout + proc.stderr
    assert "Trained 3 steps" in proc.stdout
    study = json.loads((tmp_path / "run" / "eval_length" / "length.json").read_text())
    assert study["validation_tokens"] == len(val)


CONCURRENT = """
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(message)s")
from gptlab.data import corpus
corpus.prepare(corpus.DataSpec(path=sys.argv[1], cache_dir=sys.argv[2]), "gpt2")
"""


def test_a_process_preparing_a_cache_another_one_prepares_waits_for_it(tmp_path):
    import fcntl
    import shutil

    make_corpus(tmp_path / "c.jsonl", 500)
    cache = tmp_path / "cache"
    built = corpus.prepare(DataSpec(path=str(tmp_path / "c.jsonl"), cache_dir=str(cache)), "gpt2")
    folder = Path(built.train.shards[0].path).parent
    shutil.move(folder, tmp_path / "finished")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    with open(cache / f"{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # as the process that prepares it holds it
        proc = subprocess.Popen(
            [sys.executable, "-c", CONCURRENT, str(tmp_path / "c.jsonl"), str(cache)],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        waited = False
        for line in proc.stderr:
            if "Another process is preparing" in line:
                waited = True
                break
        assert waited, "the second process did not wait for the lock"
        shutil.move(tmp_path / "finished", folder)  # the first process finishes: its cache appears
    rest = proc.stderr.read()
    assert proc.wait(timeout=600) == 0, rest
    assert "Preparing" not in rest  # it used the cache the first one made
