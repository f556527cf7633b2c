"""Passkey retrieval: prompts of exact length with the key at its depth, answers equal to the model's own greedy
decoding, repeatable trials, plain reports where a length cannot run, and the study in a trained run's length
evaluation, W&B run and sweep comparison."""

import json
import math
import re
import string

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import run_train, strict_json

from gptlab.data.tokenizers import CharTokenizer, GPT2Tokenizer, WordTokenizer
from gptlab.evaluation import long_context, passkey
from gptlab.model.config import GPTConfig
from gptlab.model.gpt import GPT
from gptlab.tracking.wandb_runs import find_runs, read_run

CHARS = CharTokenizer.from_texts([string.printable])


def tiny_model(pos: str = "rope", vocab: int = CHARS.vocab_size, block_size: int = 32) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=vocab, block_size=block_size, n_layer=1, n_head=2, n_embd=16, pos=pos)
    return GPT(config).eval()


@pytest.mark.parametrize("tokenizer", [CHARS, GPT2Tokenizer()], ids=["char", "gpt2"])
def test_prompts_take_the_exact_length_with_the_key_inside_its_depth_bin(tokenizer):
    for length in (160, 400):
        for bin_ in passkey.depth_bins(4):
            prompts = passkey.build_prompts(tokenizer, length, bin_, 6, (0, length, 1), 5)
            assert {len(p.ids) + max(len(q.answer_ids) for q in prompts) for p in prompts} == {length}
            for p in prompts:
                assert bin_[0] <= p.depth <= bin_[1] and 10_000 <= p.key <= 99_999
                text = tokenizer.decode(p.ids)
                sentence = passkey.KEY_SENTENCE.format(key=p.key).strip()
                assert text.count(sentence) == 1 and text.endswith(passkey.QUESTION)
                # The key sentence sits at its depth of the filler (to within a filler sentence).
                before = text.index(sentence) - (len(passkey.INTRO) if p.intro else 0)
                filler = (
                    len(text) - len(sentence) - len(passkey.QUESTION) - (len(passkey.INTRO) if p.intro else 0)
                )
                if (
                    tokenizer.name == "char"
                ):  # one token per character: exact but for the sentence's leading space
                    assert abs(before - p.depth * filler) <= 1.5
                else:
                    assert abs(before / filler - p.depth) < 0.05
    # Repeatable: the same (seed, length, bin) gives the same keys; another seed gives others.
    again = passkey.build_prompts(tokenizer, 400, (0, 0.25), 6, (0, 400, 1), 5)
    assert [p.ids for p in again] == [
        p.ids for p in passkey.build_prompts(tokenizer, 400, (0, 0.25), 6, (0, 400, 1), 5)
    ]
    other = passkey.build_prompts(tokenizer, 400, (0, 0.25), 6, (1, 400, 1), 5)
    assert [p.key for p in other] != [p.key for p in again]


def test_answers_are_the_models_greedy_continuation_and_the_key_logprob_its_own():
    model = tiny_model("rope")
    options = passkey.PasskeyOptions(depths=2, trials=3, seed=7)
    result = passkey.evaluate_passkey(model, CHARS, 32, [4, 8], options)
    again = passkey.evaluate_passkey(model, CHARS, 32, [4, 8], options)
    for factor in (4, 8):
        for b, (label, cell) in enumerate(result["cells"][str(factor)].items()):
            prompts = passkey.build_prompts(
                CHARS, 32 * factor, passkey.depth_bins(2)[b], 3, (7, factor, b), options.key_digits
            )
            assert [e["key"] for e in cell["examples"]] == [p.key for p in prompts]
            repeated = again["cells"][str(factor)][label]["examples"]
            assert [(e["key"], e["answer"]) for e in cell["examples"]] == [
                (e["key"], e["answer"]) for e in repeated
            ]
            for p, example in zip(prompts, cell["examples"]):
                ids = torch.tensor([p.ids])
                out = model.generate(ids, len(p.answer_ids), temperature=0.0, use_cache=False)
                answer = CHARS.decode(out[0, ids.size(1) :].tolist())
                assert example["answer"] == answer
                found = re.search(r"\d+", answer)
                assert example["correct"] == bool(found and found.group() == str(p.key))
                # Teacher-forced log-probability of " <key>" after the prompt, in one full forward pass.
                key_ids = CHARS.encode(f" {p.key}")
                logits, _ = model(torch.tensor([p.ids + key_ids[:-1]]))
                logprobs = F.log_softmax(logits[0, -len(key_ids) :].double(), -1)
                direct = float(logprobs[torch.arange(len(key_ids)), torch.tensor(key_ids)].mean())
                assert example["key_logprob"] == pytest.approx(direct, abs=1e-4)
            assert cell["accuracy"] == np.mean([e["correct"] for e in cell["examples"]])
        assert result["metrics"][f"passkey/acc@{factor}x"] == np.mean(
            [c["accuracy"] for c in result["cells"][str(factor)].values()]
        )


def test_context_scalings_run_on_the_same_prompts_and_leave_the_scheme_as_trained():
    model = tiny_model("rope")
    options = passkey.PasskeyOptions(depths=2, trials=2)
    plain = passkey.evaluate_passkey(model, CHARS, 32, [1, 8], options)
    result = passkey.evaluate_passkey(model, CHARS, 32, [1, 8], options, scalings=["ntk", "linear"])
    assert set(result["scaled"]) == {"rope+ntk", "rope+linear"}

    def timeless(cells):
        return {
            f: {b: {k: v for k, v in c.items() if k != "seconds"} for b, c in row.items()}
            for f, row in cells.items()
        }

    # The scheme is as trained after each scaled pass.
    after = passkey.evaluate_passkey(model, CHARS, 32, [1, 8], options)
    assert timeless(result["cells"]) == timeless(plain["cells"]) == timeless(after["cells"])
    scaled = result["scaled"]["rope+ntk"]
    assert set(scaled["cells"]) == {"8"}  # at 1x a scaling is the model as trained
    for b, cell in scaled["cells"]["8"].items():
        assert [e["key"] for e in cell["examples"]] == [e["key"] for e in result["cells"]["8"][b]["examples"]]
    assert scaled["metrics"]["passkey/rope+ntk/key_logprob@8x"] != result["metrics"]["passkey/key_logprob@8x"]
    assert "| rope+ntk 8x (256) |" in passkey.format_table(result)
    nope = passkey.evaluate_passkey(tiny_model("nope"), CHARS, 32, [8], options, scalings=["ntk"])
    assert nope["scaled"] == {}


def test_lengths_that_cannot_run_say_why_in_every_cell(tmp_path):
    learned = tiny_model("learned", block_size=128)
    result = passkey.evaluate_passkey(
        learned, CHARS, 32, [1, 4, 8], passkey.PasskeyOptions(depths=3, trials=2)
    )
    for cell in result["cells"]["1"].values():
        assert (
            "accuracy" not in cell and "needs at least" in cell["error"] and "more than 32" in cell["error"]
        )
    assert all(
        "accuracy" in cell for cell in result["cells"]["4"].values()
    )  # 128 positions: inside the table
    for cell in result["cells"]["8"].values():
        assert cell["error"] == "pos=learned has a table of 128 positions, so it cannot run at 256 tokens"
    table = passkey.format_table(result)
    assert "| 1x (32) | too short | too short | too short |" in table
    assert "| 8x (256) | cannot run | cannot run | cannot run | - | - |" in table
    paths = passkey.write_outputs(result, tmp_path)
    assert [p.name for p in paths] == ["passkey.json", "passkey.md", "passkey.png"]
    assert paths[2].read_bytes()[:4] == b"\x89PNG"
    assert json.loads(paths[0].read_text())["cells"]["8"]["0-33%"]["context"] == 256


def test_vocabularies_without_digits_are_reported_not_scored():
    words = WordTokenizer.from_texts(
        [passkey.INTRO + passkey.FILLER + passkey.QUESTION + " The pass key is . Remember it."]
    )
    result = passkey.evaluate_passkey(tiny_model("nope", vocab=words.vocab_size), words, 64, [2, 4])
    assert "tokenizer=word cannot encode the pass key's digits" in result["error"]
    assert result["cells"] == {} and passkey.format_table(result).startswith("passkey retrieval not run")
    no_digits = CharTokenizer.from_texts([string.ascii_letters + " .?"])
    result = passkey.evaluate_passkey(tiny_model("nope", vocab=no_digits.vocab_size), no_digits, 64, [2])
    assert "tokenizer=char cannot encode the pass key's digits" in result["error"]


def test_bad_options_are_refused():
    from gptlab.errors import ConfigError

    with pytest.raises(ConfigError, match=r"eval_length.passkey.trials=0 must be a positive integer"):
        passkey.PasskeyOptions(trials=0)
    with pytest.raises(
        ConfigError,
        match=r"eval_length.passkey does not take option\(s\) eval_length.passkey.depth\..*Did you mean eval_length.passkey.depths\?",
    ):
        passkey.PasskeyOptions.from_dict({"depth": 3})


TINY_RUN = [
    "tokenizer=char",
    "pos=rope",
    "model.n_layer=1",
    "model.n_head=2",
    "model.n_embd=32",
    "model.block_size=64",
    "data.batch_size=8",
    "trainer.max_steps=10",
    "trainer.val_check_interval=10",
    "trainer.limit_val_batches=2",
    "callbacks.sample_generation.max_new_tokens=2",
    "eval_length.enabled=true",
    "eval_length.factors=[1,2,4]",
    "eval_length.max_tokens=1025",
    "eval_length.passkey.trials=2",
    "eval_length.passkey.depths=2",
]


def test_the_length_study_after_training_runs_passkey_and_logs_it(tmp_path):
    run_train([*TINY_RUN, f"paths.root_dir={tmp_path}"], cwd=tmp_path, env={"OMP_NUM_THREADS": "1"})
    (run_dir,) = (tmp_path / "outputs" / "runs").glob("*/*")
    result = json.loads((run_dir / "eval_length" / "passkey.json").read_text())
    assert result["factors"] == [1, 2, 4] and result["train_context"] == 64 and result["tokenizer"] == "char"
    assert "too short" in (run_dir / "eval_length" / "passkey.md").read_text()  # 64 characters: no room
    # gptlab's JSON files of the run (W&B's own aside) are strict JSON
    ours = [p for p in run_dir.rglob("*.json") if "wandb" not in p.relative_to(run_dir).parts]
    assert {p.name for p in ours} >= {"result.json", "run.json", "length.json", "passkey.json"}
    assert (
        all(strict_json(p) for p in ours) and strict_json(run_dir / "eval_length" / "passkey.json") == result
    )
    (train_run,) = [read_run(p) for p in find_runs(run_dir / "wandb")]
    assert "passkey/acc@1x" not in train_run.summary
    assert train_run.summary["passkey/acc@4x"] == pytest.approx(result["metrics"]["passkey/acc@4x"])
    assert train_run.summary["length/passkey/_type"] == "image-file"
    # The sweep comparison carries the passkey columns and draws perplexity and passkey against length.
    assert long_context.read_passkey(run_dir) == {
        "passkey@1x": None,
        "passkey@2x": result["metrics"]["passkey/acc@2x"],
        "passkey@4x": result["metrics"]["passkey/acc@4x"],
    }
    ppl = long_context.read_length_study(run_dir)
    assert ppl["ppl@1x"] == pytest.approx(math.exp(train_run.summary["length/loss@1x"]))
    from gptlab.comparison.report import compare

    comparison = compare(tmp_path / "outputs" / "runs", tmp_path / "cmp")
    header = comparison.table.splitlines()[0]
    assert "| ppl@1x | ppl@2x | ppl@4x | passkey@1x | passkey@2x | passkey@4x |" in header
    assert comparison.table.splitlines()[2].split(" | ")[-3] == "n/a"  # passkey@1x: the prompt cannot fit
    assert (tmp_path / "cmp" / "long_context.png").read_bytes()[:4] == b"\x89PNG"
    table = long_context.passkey_sweep_table(long_context.collect_passkey([tmp_path / "outputs" / "runs"]))
    assert "| rope | 1 | too short |" in table


@torch.no_grad()
def test_each_prompt_gets_the_figures_it_gets_alone_whatever_else_shares_its_batch():
    """Under GPT-2's BPE a 5-digit key's answer (" 12345.") takes 3 or 4 tokens, so the prompts of one batch
    can have answers of different lengths. Each prompt's answer is its own greedy continuation to its own
    answer's length and its key log-probability its own key's, as when it is scored alone, so the study's
    figures are the same in batches of 2 (a smaller last batch of 1) as in one batch of all."""
    gpt2 = GPT2Tokenizer()
    model = tiny_model("alibi", vocab=gpt2.vocab_size, block_size=64)

    def study(batch_tokens: int) -> dict:
        options = passkey.PasskeyOptions(depths=2, trials=5, seed=3, batch_tokens=batch_tokens)
        result = passkey.evaluate_passkey(model, gpt2, 64, [1, 2], options)
        for row in result["cells"].values():
            for cell in row.values():
                del cell["seconds"]
        return result

    def exact(result: dict) -> list:  # all but the log-probabilities, which a batch's size moves by ~1e-10
        return [
            (f, b, k, v if k != "examples" else [{**e, "key_logprob": None} for e in v])
            for f, row in result["cells"].items()
            for b, cell in row.items()
            for k, v in cell.items()
            if k != "key_logprob"
        ] + [(k, v) for k, v in result["metrics"].items() if "acc@" in k]

    in_twos, all_at_once = study(2 * 64), study(5 * 128)
    assert exact(in_twos) == exact(all_at_once)
    assert in_twos["metrics"] == pytest.approx(all_at_once["metrics"], rel=1e-8)
    mixed = 0  # batches with answers of different lengths
    for factor in (1, 2):
        for b, cell in enumerate(in_twos["cells"][str(factor)].values()):
            prompts = passkey.build_prompts(gpt2, 64 * factor, passkey.depth_bins(2)[b], 5, (3, factor, b), 5)
            batches = [prompts] if factor == 2 else [prompts[0:2], prompts[2:4]]  # of 2 (at 1x) and of 5
            mixed += sum(len({len(p.answer_ids) for p in batch}) > 1 for batch in batches)
            for p, example in zip(prompts, cell["examples"], strict=True):
                ids = torch.tensor([p.ids])
                out = model.generate(ids, len(p.answer_ids), temperature=0.0, use_cache=False)
                assert example["answer"] == gpt2.decode(out[0, ids.size(1) :].tolist())
                key_ids = gpt2.encode(f" {p.key}")
                logits, _ = model(torch.tensor([p.ids + key_ids[:-1]]))
                logprobs = F.log_softmax(logits[0, -len(key_ids) :].double(), -1)
                alone = float(logprobs[torch.arange(len(key_ids)), torch.tensor(key_ids)].mean())
                assert example["key_logprob"] == pytest.approx(alone, abs=1e-6)
                (single,) = passkey.score_prompts(model, [p], gpt2)
                assert example == {**single, "key_logprob": pytest.approx(single["key_logprob"], rel=1e-8)}
    assert mixed >= 2  # batches that hold answers of 3 and of 4 tokens


def test_the_study_is_the_same_when_its_prompts_go_in_chunks(monkeypatch):
    """The prompt goes into the KV cache through GPT.prefill, in chunks whose dense ALiBi mask stays within
    PREFILL_MASK_BYTES: with a budget of a few queries per chunk, the answers and accuracies are those of one
    call per prompt, the key log-probabilities the same to fp32 rounding."""
    from gptlab.model import gpt

    gpt2 = GPT2Tokenizer()
    model = tiny_model("alibi", vocab=gpt2.vocab_size, block_size=64)
    options = passkey.PasskeyOptions(depths=2, trials=3, seed=5)

    def study() -> dict:
        result = passkey.evaluate_passkey(model, gpt2, 64, [1, 2], options)
        for row in result["cells"].values():
            for cell in row.values():
                del cell["seconds"]
        return result

    def answers(result: dict) -> list:
        return [
            [(e["answer"], e["correct"], e["digits_right"]) for e in cell["examples"]]
            for row in result["cells"].values()
            for cell in row.values()
        ]

    one_call = study()
    chunks: list[int] = []
    chunk_of = gpt.prefill_chunk

    def recording_chunk(*args, **kwargs) -> int:
        chunks.append(chunk_of(*args, **kwargs))
        return chunks[-1]

    monkeypatch.setattr(gpt, "prefill_chunk", recording_chunk)
    monkeypatch.setattr(gpt, "PREFILL_MASK_BYTES", 2 * 128 * 4 * 9)  # 9 queries over 128 keys, 2 heads
    chunked = study()
    assert chunks and max(chunks) < 64  # every prompt (64 and 128 tokens) went in several chunks
    assert answers(chunked) == answers(one_call)
    assert {k: v for k, v in chunked["metrics"].items() if "acc@" in k} == {
        k: v for k, v in one_call["metrics"].items() if "acc@" in k
    }
    assert chunked["metrics"] == pytest.approx(one_call["metrics"], rel=1e-5)
