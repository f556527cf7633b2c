"""Bits per byte: the bytes a token covers come from its tokenizer, the same text counts the same bytes under
char, word and gpt2, and every reported bpb is the summed nats over the summed bytes, in bits."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gptlab.data import tokenizers
from gptlab.data.token_bytes import TokenBytes, bits_per_byte
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
