"""data.streaming=true: local jsonl files through datasets' streaming mode (the code path of hub datasets)."""

import io
import itertools
import json
import signal
import threading
import time

import numpy as np
import pytest
import torch
from conftest import CONF, TINY, run_train
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from gptlab.data import corpus
from gptlab.data.datamodule import GPTDataModule
from gptlab.data.sources import DataSpec
from gptlab.data.streaming import StreamingWindows, held_out, held_out_shards
from gptlab.data.tokenizers import GPT2Tokenizer
from gptlab.errors import ConfigError
from gptlab.runs.layout import last_checkpoint
from gptlab.tasks.gpt import run


def make_jsonl(path, n_docs=300, seed=0):
    rng = np.random.default_rng(seed)
    words = "the of and a to in is that for it as was with be by on not he this are or his".split()
    docs = [
        f"Story {i}: " + " ".join(rng.choice(words, size=int(rng.integers(10, 90)))) for i in range(n_docs)
    ]
    with open(path, "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    return docs


def one_epoch(stream):
    """The windows of one pass over the stream."""
    for x, y in stream:
        if stream._epoch:
            return
        yield x, y


def round_trip(state):
    """The state as a checkpoint stores and loads it."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_a_stream_resumed_from_its_state_continues_at_the_same_token(tmp_path):
    make_jsonl(tmp_path / "d.jsonl")
    spec = DataSpec(path=str(tmp_path / "d.jsonl"), streaming=True, cache_dir=str(tmp_path / "c"))
    tok = GPT2Tokenizer()
    one_pass = len(list(one_epoch(StreamingWindows(spec, tok, window=17))))
    assert one_pass > 40
    reference = [
        x.tolist() for x, _ in itertools.islice(StreamingWindows(spec, tok, window=17), 2 * one_pass)
    ]
    assert reference[:one_pass] == reference[one_pass:]  # at its end, the stream is read again from its start
    for stop in (23, one_pass + 5):
        first = StreamingWindows(spec, tok, window=17)
        it = iter(first)
        for _ in range(stop):
            next(it)
        state = round_trip(first.state_dict())
        resumed = StreamingWindows(spec, tok, window=17)
        resumed.load_state_dict(state)
        rest = [x.tolist() for x, _ in itertools.islice(resumed, 2 * one_pass - stop)]
        assert rest == reference[stop:]


def test_training_skips_the_held_out_documents_and_ranks_read_disjoint_parts(tmp_path):
    docs = make_jsonl(tmp_path / "d.jsonl")
    spec = DataSpec(path=str(tmp_path / "d.jsonl"), streaming=True, cache_dir=str(tmp_path / "c"))
    tok = GPT2Tokenizer()
    kept = [d for d in docs if not held_out(d, spec.split_seed, spec.val_fraction)]
    assert 0.8 * len(docs) < len(kept) < len(docs)
    expected = np.concatenate([tok.encode(d) + [tok.eot_id] for d in kept])
    windows = list(one_epoch(StreamingWindows(spec, tok, window=33)))
    stream = np.concatenate([x.numpy() for x, _ in windows] + [windows[-1][1][-1:].numpy()])
    assert np.array_equal(stream, expected[: len(stream)])  # windows tile the training documents in order
    val = held_out_shards(spec, tok)
    held = [d for d in docs if held_out(d, spec.split_seed, spec.val_fraction)]
    assert np.array_equal(val.array(), np.concatenate([tok.encode(d) + [tok.eot_id] for d in held]))

    parts = [StreamingWindows(spec, tok, window=33, rank=r, world_size=2) for r in (0, 1)]
    texts = [[tok.decode(x.tolist()) for x, _ in one_epoch(p)] for p in parts]
    assert texts[0] and texts[1] and not set(texts[0]) & set(texts[1])


def test_a_learned_vocabulary_cannot_stream(tmp_path):
    make_jsonl(tmp_path / "d.jsonl", n_docs=20)
    dm = GPTDataModule(DataSpec(path=str(tmp_path / "d.jsonl"), streaming=True), "word", 16, 2)
    with pytest.raises(ConfigError, match="tokenizer=gpt2"):
        dm.setup("fit")


MAX_STEPS = 12
ARGS = [
    *TINY,
    f"trainer.max_steps={MAX_STEPS}",
    "optim.warmup_steps=2",
    "callbacks.last_checkpoint.every_n_train_steps=2",
    "data.streaming=true",
    "logger=none",
]


def compose_cfg(*overrides):
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("train", overrides=list(overrides))


@pytest.mark.parametrize("source", ["stream", "sharded cache"])
def test_a_run_stopped_and_resumed_ends_bit_identical_to_an_uninterrupted_one(tmp_path, monkeypatch, source):
    make_jsonl(tmp_path / "d.jsonl", n_docs=2500)
    common = [*ARGS, f"data.path={tmp_path / 'd.jsonl'}", f"paths.root_dir={tmp_path}"]
    if source == "sharded cache":  # one shard per Arrow record batch, written by two processes
        monkeypatch.setattr(corpus, "MIN_TASK_CHARS", 1000)
        common += ["data.streaming=false", "data.num_proc=2"]
    run(compose_cfg(*common, f"paths.output_dir={tmp_path / 'ref'}"))
    reference = torch.load(last_checkpoint(tmp_path / "ref"), weights_only=True)
    if source == "sharded cache":
        (index,) = tmp_path.glob("**/index.json")
        assert len(json.loads(index.read_text())["splits"]["train"]) > 1

    out = tmp_path / "run"
    ckpt = last_checkpoint(out)

    def stop_after_first_checkpoint():
        # as long as a loaded machine needs to get there; never a signal before the checkpoint: the
        # test's assertions then say the run was not stopped
        deadline = time.monotonic() + 600
        while not ckpt.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        if ckpt.exists():
            signal.raise_signal(signal.SIGTERM)

    threading.Thread(target=stop_after_first_checkpoint, daemon=True).start()
    run(compose_cfg(*common, f"paths.output_dir={out}"))
    stopped = torch.load(ckpt, weights_only=True)
    assert 2 <= stopped["global_step"] < MAX_STEPS
    run(compose_cfg(*common, f"paths.output_dir={out}", "resume=auto"))
    final = torch.load(ckpt, weights_only=True)
    assert final["global_step"] == MAX_STEPS
    different = [k for k, v in reference["state_dict"].items() if not torch.equal(v, final["state_dict"][k])]
    assert not different


@pytest.mark.slow
def test_a_streaming_run_trains_under_two_ddp_processes(tmp_path):
    make_jsonl(tmp_path / "d.jsonl", n_docs=600)
    args = [
        *ARGS,
        "trainer.max_steps=4",
        f"data.path={tmp_path / 'd.jsonl'}",
        f"paths.root_dir={tmp_path}",
        "strategy=ddp",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
    ]
    proc = run_train(args, cwd=tmp_path)
    assert "Starting with 2 processes" in proc.stdout + proc.stderr  # rank 0's: every rank joined
    assert "Trained 4 steps" in proc.stdout


def test_validation_tokens_of_a_stream_and_of_a_cache(tmp_path):
    docs = make_jsonl(tmp_path / "d.jsonl", n_docs=200)
    tok = GPT2Tokenizer()
    spec = DataSpec(path=str(tmp_path / "d.jsonl"), streaming=True, cache_dir=str(tmp_path / "c"))
    val, got = corpus.validation_tokens(spec, "gpt2")
    held = [d for d in docs if held_out(d, spec.split_seed, spec.val_fraction)]
    assert got.name == "gpt2" and val.tolist() == [t for d in held for t in tok.encode(d) + [tok.eot_id]]
    assert not any(p.is_dir() for p in (tmp_path / "c").iterdir())  # a stream prepares no cache
    spec.streaming = False
    val, _ = corpus.validation_tokens(spec, {"name": "gpt2"})
    assert np.array_equal(val, corpus.prepare(spec, "gpt2").val.array())


def reader_windows(stream, loader_workers=0):
    """One pass of windows from each reader of ``stream``: {reader index: [window tokens]}, read through a
    DataLoader with ``loader_workers`` workers (each worker's windows kept apart by the worker id)."""
    from torch.utils.data import DataLoader, get_worker_info

    class Tagged(torch.utils.data.IterableDataset):
        def __iter__(self):
            info = get_worker_info()
            for x, y in one_epoch(stream):
                yield (info.id if info else 0), torch.cat([x, y[-1:]])

    by_reader: dict[int, list] = {}
    for worker, window in DataLoader(Tagged(), batch_size=None, num_workers=loader_workers):
        by_reader.setdefault(stream.rank * max(1, loader_workers) + int(worker), []).append(window)
    return by_reader


def assert_windows_tile(windows, documents, tok, window):
    """The windows cut the documents' tokens in order, each starting at the last token of the one before,
    leaving less than a window at the end."""
    expected = np.concatenate([tok.encode(d) + [tok.eot_id] for d in documents])
    got = np.concatenate([windows[0].numpy()] + [w[1:].numpy() for w in windows[1:]])
    assert np.array_equal(got, expected[: len(got)])
    assert len(expected) - len(got) < window


@pytest.mark.parametrize(("world_size", "workers"), [(1, 2), (2, 1), (2, 2)])
def test_every_worker_of_every_rank_reads_its_own_share_of_a_one_file_corpus(tmp_path, world_size, workers):
    docs = make_jsonl(tmp_path / "d.jsonl", n_docs=120)
    spec = DataSpec(path=str(tmp_path / "d.jsonl"), streaming=True, cache_dir=str(tmp_path / "c"))
    tok = GPT2Tokenizer()
    readers = world_size * workers
    windows: dict[int, list] = {}
    for rank in range(world_size):
        stream = StreamingWindows(spec, tok, window=33, rank=rank, world_size=world_size)
        windows.update(reader_windows(stream, loader_workers=workers if workers > 1 else 0))
    assert sorted(windows) == list(range(readers))  # every reader got windows
    # reader k takes every n-th document: every training document is read by exactly one reader, each
    # reader's windows tile its documents (no window twice, none skipped but the last part-window)
    for k, got in windows.items():
        mine = [d for i, d in enumerate(docs) if i % readers == k]
        kept = [d for d in mine if not held_out(d, spec.split_seed, spec.val_fraction)]
        assert_windows_tile(got, kept, tok, 33)
    all_windows = [tuple(w.tolist()) for got in windows.values() for w in got]
    assert len(set(all_windows)) == len(all_windows)


def test_a_streaming_loader_with_two_workers_resumes_at_the_same_window(tmp_path):
    from torchdata.stateful_dataloader import StatefulDataLoader

    make_jsonl(tmp_path / "d.jsonl", n_docs=200)
    spec = DataSpec(path=str(tmp_path / "d.jsonl"), streaming=True, cache_dir=str(tmp_path / "c"))
    tok = GPT2Tokenizer()

    def loader():
        return StatefulDataLoader(StreamingWindows(spec, tok, window=17), batch_size=4, num_workers=2)

    reference = [x for x, _ in itertools.islice(loader(), 30)]
    first = loader()
    it = iter(first)
    for _ in range(11):
        next(it)
    state = round_trip(first.state_dict())
    del it
    resumed = loader()
    resumed.load_state_dict(state)
    rest = [x for x, _ in itertools.islice(resumed, 19)]
    assert all(torch.equal(a, b) for a, b in zip(rest, reference[11:], strict=True))


def test_a_streaming_run_with_two_loader_workers_trains_on_a_one_file_corpus(tmp_path):
    make_jsonl(tmp_path / "d.jsonl", n_docs=300)
    metrics = run(
        compose_cfg(
            *ARGS,
            "trainer.max_steps=4",
            "data.num_workers=2",
            f"data.path={tmp_path / 'd.jsonl'}",
            f"paths.root_dir={tmp_path}",
            f"paths.output_dir={tmp_path / 'run'}",
        )
    )
    assert np.isfinite(metrics["val/loss"])
    assert torch.load(last_checkpoint(tmp_path / "run"), weights_only=True)["global_step"] == 4


@pytest.mark.parametrize("streaming", [False, True])
def test_lightnings_advice_for_more_loader_workers_stands_for_a_stream_alone(
    tmp_path, monkeypatch, streaming
):
    """On a machine with many cores (every GPU machine) Lightning advises more loader workers for every loader
    with fewer than 2. Windows read from the token cache need none (a batch is a few slices of a memory map):
    the advice is silenced for them. A stream tokenizes as it reads: its training loader keeps the advice."""
    import warnings

    from lightning.pytorch.trainer.connectors import data_connector

    monkeypatch.setattr(data_connector, "suggested_max_num_workers", lambda devices: 15)
    make_jsonl(tmp_path / "d.jsonl", n_docs=300)
    args = [*ARGS, "trainer.max_steps=2", f"data.path={tmp_path / 'd.jsonl'}", f"paths.root_dir={tmp_path}"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(
            compose_cfg(
                *args, f"data.streaming={str(streaming).lower()}", f"paths.output_dir={tmp_path / 'run'}"
            )
        )
    advised = sorted(
        name
        for name in ("train_dataloader", "val_dataloader")
        if any(f"The '{name}' does not have many workers" in str(w.message) for w in caught)
    )
    assert advised == (["train_dataloader"] if streaming else [])
