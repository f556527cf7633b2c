import json

import numpy as np
import pytest
import torch

from gptlab.data import corpus
from gptlab.data.corpus import DataSpec, num_windows
from gptlab.data.datamodule import GPTDataModule, TokenWindows
from gptlab.data.shards import Shard, TokenShards
from gptlab.errors import ConfigError, DataError


def write_tokens(path, n):
    arr = np.arange(n, dtype=np.uint16)
    arr.tofile(path)
    return arr


@pytest.mark.parametrize(
    "n,block,stride", [(100, 9, 10), (100, 9, 3), (100, 9, 25), (11, 10, 4), (10, 10, 1)]
)
def test_windows_follow_the_stride_arithmetic(tmp_path, n, block, stride):
    tokens = write_tokens(tmp_path / "t.bin", n)
    one_file = TokenShards([Shard(str(tmp_path / "t.bin"), n)], np.uint16)
    ds = TokenWindows(one_file, block_size=block, stride=stride)
    window = block + 1
    expected = 0 if n < window else (n - window) // stride + 1
    assert len(ds) == expected == num_windows(n, window, stride)
    for i in range(len(ds)):
        x, y = ds[i]
        start = i * stride
        assert x.tolist() == tokens[start : start + block].tolist()
        assert y.tolist() == tokens[start + 1 : start + block + 1].tolist()  # the target is shifted by one
        assert x.dtype == torch.int64
    # the last window ends inside the corpus; one more would not fit
    if len(ds):
        assert (len(ds) - 1) * stride + window <= n < len(ds) * stride + window


def make_docs(tmp_path, n_docs=30, words=200):
    rng = np.random.default_rng(0)
    vocab = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta", "the", "of", "and", "."]
    docs = [" ".join(rng.choice(vocab, size=words)) for _ in range(n_docs)]
    return docs


def test_local_files_txt_jsonl_parquet_are_tokenized_and_cached(tmp_path):
    import datasets

    docs = make_docs(tmp_path)
    (tmp_path / "txt").mkdir()
    for i, d in enumerate(docs):
        (tmp_path / "txt" / f"doc{i:02d}.txt").write_text(d)
    with open(tmp_path / "docs.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"body": d}) + "\n")
    datasets.Dataset.from_dict({"text": docs}).to_parquet(str(tmp_path / "docs.parquet"))
    results = {}
    for name, spec in {
        "txt": DataSpec(path=str(tmp_path / "txt" / "*.txt")),
        "jsonl": DataSpec(path=str(tmp_path / "docs.jsonl"), text_field="body"),
        "parquet": DataSpec(path=str(tmp_path / "docs.parquet")),
    }.items():
        spec.cache_dir = str(tmp_path / "cache")
        prepared = corpus.prepare(spec, "gpt2")
        train, val = prepared.train.array(), prepared.val.array()
        meta = prepared.meta
        assert meta["splits"]["train"]["documents"] + meta["splits"]["val"]["documents"] == len(docs)
        # every document ends with <|endoftext|>
        assert (train == 50256).sum() == meta["splits"]["train"]["documents"]
        assert (val == 50256).sum() == meta["splits"]["val"]["documents"]
        results[name] = sorted(train.tolist()) + sorted(val.tolist())
    # the same documents give the same tokens whatever the file format
    assert results["txt"] == results["jsonl"] == results["parquet"]


def test_tokenizing_into_a_file_or_a_pipe_logs_lines_and_draws_no_bar(tmp_path, capsys, caplog, monkeypatch):
    """Where stderr is not a terminal (a SLURM log, a file), the tokenization's progress comes as log lines
    (here one for each report: the interval set to 0 s), not as a bar redrawn with carriage returns."""
    import logging

    from gptlab.data import tokenize_pool

    monkeypatch.setattr(tokenize_pool, "PROGRESS_LINE_SECONDS", 0.0)
    spec = DataSpec(cache_dir=str(tmp_path / "cache"))  # the embedded corpus: 79 documents
    with caplog.at_level(logging.INFO, logger="gptlab.data.tokenize_pool"):
        corpus.prepare(spec, "gpt2")
    err = capsys.readouterr().err
    assert "\r" not in err and "doc/s" not in err, err
    lines = [r.getMessage() for r in caplog.records if r.name == "gptlab.data.tokenize_pool"]
    assert lines and lines[-1].startswith("Tokenizing ") and lines[-1].endswith(" tok/s"), lines
    assert ": 79 / 79 documents, " in lines[-1], lines


def test_token_cache_is_reused(tmp_path, monkeypatch):
    spec = DataSpec(cache_dir=str(tmp_path / "cache"))
    first = corpus.prepare(spec, "gpt2")
    calls = []
    monkeypatch.setattr(corpus, "_build_cache", lambda *a, **k: calls.append(a))
    second = corpus.prepare(spec, "gpt2")
    assert calls == []  # no rebuild
    assert second.train.shards == first.train.shards
    assert first.meta["splits"]["train"]["tokens"] > 100_000  # the embedded corpus is real text
    assert 5.0 < first.unigram_entropy < 6.5


def test_the_unigram_baseline_is_the_validation_splits_entropy_for_a_cache_old_or_new(tmp_path):
    # one definition for every source: the entropy of the validation tokens' own frequencies (the lowest loss
    # a model that ignores context can score on them), not the whole corpus's; a cache whose meta.json
    # recorded another figure (a cache prepared before) is held against the same number
    prepared = corpus.prepare(DataSpec(cache_dir=str(tmp_path / "cache")), "gpt2")
    val = np.asarray(prepared.val.array())
    counts = np.bincount(val)
    p = counts[counts > 0] / len(val)
    expected = float(-(p * np.log(p)).sum())
    assert prepared.unigram_entropy == pytest.approx(expected, rel=1e-12)
    assert prepared.meta["unigram_entropy_nats"] == pytest.approx(expected, rel=1e-12)  # and the log's
    train = np.asarray(prepared.train.array())
    whole = np.bincount(np.concatenate([train, val]))
    q = whole[whole > 0] / whole.sum()
    assert abs(float(-(q * np.log(q)).sum()) - expected) > 0.1  # the two definitions differ here
    cache = next(d for d in (tmp_path / "cache").iterdir() if (d / "meta.json").is_file())
    meta = json.loads((cache / "meta.json").read_text())
    meta["unigram_entropy_nats"] = 5.5745  # as a cache of the earlier format recorded it: the whole corpus
    (cache / "meta.json").write_text(json.dumps(meta))
    assert corpus.prepare(
        DataSpec(cache_dir=str(tmp_path / "cache")), "gpt2"
    ).unigram_entropy == pytest.approx(expected, rel=1e-12)


def test_document_split_is_deterministic_and_by_document(tmp_path):
    lengths = [100 + 7 * i for i in range(50)]
    a = corpus.split_documents(lengths, 0.1, seed=3)
    b = corpus.split_documents(lengths, 0.1, seed=3)
    c = corpus.split_documents(lengths, 0.1, seed=4)
    assert (a == b).all() and not (a == c).all()
    share = np.asarray(lengths)[a].sum() / sum(lengths)
    assert 0.1 <= share < 0.1 + max(lengths) / sum(lengths)


def test_single_document_is_split_at_its_tail(tmp_path):
    text = "\n".join(f"line {i} of a single long book" for i in range(2000))
    (tmp_path / "book.txt").write_text(text)
    prepared = corpus.prepare(
        DataSpec(path=str(tmp_path / "book.txt"), cache_dir=str(tmp_path / "c")), "char"
    )
    val = prepared.tokenizer.decode(prepared.val.array()[:-1].tolist())
    assert text.endswith(val.strip())


def test_word_tokenizer_vocabulary_comes_from_the_training_split(tmp_path):
    docs = [f"word{i} shared ." for i in range(40)]
    for i, d in enumerate(docs):
        (tmp_path / f"{i}.txt").write_text(d)
    spec = DataSpec(path=str(tmp_path / "*.txt"), cache_dir=str(tmp_path / "c"))
    prepared = corpus.prepare(spec, {"name": "word", "max_unknown_fraction": 0.5})
    tok = prepared.tokenizer
    val = prepared.val.array()
    assert tok.unk_id in val.tolist()  # validation words unseen in training are unknown
    assert "shared" in tok.vocab
    # counted where the cache keeps its facts: one unknown "word{i}" per validation document of 3 words
    facts = prepared.meta["splits"]["val"]
    assert facts["unknown"] == (val == tok.unk_id).sum() == facts["documents"]
    assert facts["symbols"] == 3 * facts["documents"] == len(val) - facts["documents"]
    assert prepared.meta["splits"]["train"]["unknown"] == 0
    # a third of the validation words unknown: above the default threshold (10%), the same cache is refused
    with pytest.raises(ConfigError, match=r"validation split .* \(33\.3%\) not seen in training"):
        corpus.prepare(spec, "word")


def test_hub_dataset_by_name_loads_through_datasets(tmp_path):
    # A dataset repository laid out as on the hub, in a local folder: load_dataset(name) takes the same path.
    repo = tmp_path / "someone" / "tiny-corpus"
    (repo / "data").mkdir(parents=True)
    with open(repo / "data" / "train.jsonl", "w") as f:
        for d in make_docs(tmp_path, n_docs=12):
            f.write(json.dumps({"text": d}) + "\n")
    prepared = corpus.prepare(DataSpec(name=str(repo), cache_dir=str(tmp_path / "c")), "gpt2")
    assert prepared.meta["splits"]["train"]["documents"] + prepared.meta["splits"]["val"]["documents"] == 12


def test_unreachable_hub_dataset_names_the_network_and_the_local_alternative(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    spec = DataSpec(name="nobody-has/this-dataset-xyz", cache_dir=str(tmp_path / "c"))
    with pytest.raises(DataError, match=r"(?s)nobody-has/this-dataset-xyz.*network.*data\.path="):
        corpus.prepare(spec, "gpt2")


def test_missing_empty_and_non_utf8_files_are_refused(tmp_path):
    with pytest.raises(DataError, match=r"data.path='.*nothere\.txt' matches no file"):
        corpus.prepare(DataSpec(path=str(tmp_path / "nothere.txt"), cache_dir=str(tmp_path)), "gpt2")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="empty.txt' is empty"):
        corpus.prepare(DataSpec(path=str(tmp_path / "empty.txt"), cache_dir=str(tmp_path)), "gpt2")
    (tmp_path / "latin.txt").write_bytes("caf\xe9 cr\xe8me ".encode("latin-1") * 100)
    with pytest.raises(DataError, match="not UTF-8"):
        corpus.prepare(DataSpec(path=str(tmp_path / "latin.txt"), cache_dir=str(tmp_path)), "gpt2")


def test_a_text_field_that_holds_no_text_is_refused_with_the_columns_that_do(tmp_path):
    # numbers where the text should be (a jsonl written with the wrong key), or data.text_field naming an id
    path = tmp_path / "records.jsonl"
    path.write_text(
        "\n".join(json.dumps({"text": i, "body": f"document {i} " * 20, "tags": ["a"]}) for i in range(50))
    )
    for field, kind in (("text", "int64"), ("tags", "List")):
        spec = DataSpec(path=str(path), text_field=field, cache_dir=str(tmp_path / "c"))
        with pytest.raises(DataError) as refused:
            corpus.prepare(spec, "gpt2")
        assert str(refused.value) == (
            f"The column {field!r} of the corpus local files '{path}' holds {kind} values, not text. Set "
            "data.text_field to the column that holds the text (its text columns: ['body'])."
        )
    assert not (tmp_path / "c").exists() or not any(p.is_dir() for p in (tmp_path / "c").iterdir())
    prepared = corpus.prepare(
        DataSpec(path=str(path), text_field="body", cache_dir=str(tmp_path / "c")), "gpt2"
    )
    assert prepared.meta["splits"]["train"]["documents"] + prepared.meta["splits"]["val"]["documents"] == 50


def test_a_jsonl_line_that_does_not_parse_is_named_by_its_row(tmp_path):
    path = tmp_path / "docs.jsonl"
    lines = [json.dumps({"text": f"document {i} " * 20}) for i in range(60)]
    lines[40] = '{"text": "a line cut short'
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as refused:
        corpus.prepare(DataSpec(path=str(path), cache_dir=str(tmp_path / "c")), "gpt2")
    # the cause datasets wraps, with the row (counted from 0) where the file stops being JSON lines
    assert str(refused.value).startswith(f"Could not read data.path='{path}' as json: ")
    assert "(ArrowInvalid: JSON parse error: " in str(refused.value) and "in row 40)" in str(refused.value)


def test_corpus_shorter_than_one_window_is_refused(tmp_path):
    for i in range(10):
        (tmp_path / f"{i}.txt").write_text(f"tiny document number {i}.")
    dm = GPTDataModule(
        DataSpec(path=str(tmp_path / "*.txt"), cache_dir=str(tmp_path / "c")),
        "gpt2",
        block_size=64,
        batch_size=2,
    )
    with pytest.raises(DataError, match=r"fewer than one window of model.block_size \+ 1 = 65"):
        dm.setup("fit")


def test_both_sources_at_once_is_refused():
    with pytest.raises(ConfigError, match="choose one source"):
        DataSpec(path="a.txt", name="b")
