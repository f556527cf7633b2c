"""lm-evaluation-harness on a trained run: the harness's numbers equal the ones computed directly from the
model, offline, on task folders the tests write themselves."""

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, strict_json, strict_json_lines

pytest.importorskip("lm_eval")

from gptlab.evaluation import harness  # noqa: E402
from gptlab.runs.trained import load_run  # noqa: E402
from gptlab.tracking.wandb_runs import find_runs, read_run  # noqa: E402

CONTEXT = 32
TINY_RUN = [
    "tokenizer=char",
    "pos=learned",  # a bounded position table: windows and generation must stay inside it
    "model.n_layer=1",
    "model.n_head=2",
    "model.n_embd=32",
    f"model.block_size={CONTEXT}",
    "data.batch_size=8",
    "trainer.max_steps=30",
    "trainer.val_check_interval=30",
    "trainer.limit_val_batches=2",
    "optim.lr=1e-2",
    "optim.warmup_steps=5",
    "callbacks.sample_generation.max_new_tokens=2",
    "logger.wandb.group=harness_test",
]

MC_DOCS = [
    {
        "question": "The function returns",
        "choices": ["a value", "the keyword", "nothing at all"],
        "answer": 0,
    },
    {"question": "A class is", "choices": ["an object", "a statement"], "answer": 1},
    {"question": "The for loop", "choices": ["iterates over", "imports", "raises", "yields"], "answer": 0},
    {"question": "Exceptions are", "choices": ["raised", "printed"], "answer": 1},
]
PPL_DOCS = [
    {"text": "The import statement binds names in the local namespace."},
    {"text": "A short one."},
    {  # several windows of 32 characters
        "text": "When a class definition is executed, its suite is run in a new execution frame using a "
        "newly created local namespace and the original global namespace. The class name is bound to this "
        "class object in the original local namespace."
    },
]
GEN_DOCS = [{"prompt": p, "target": "x"} for p in ("The value of", "The name is", "def f(x)", "class ")]
STOPS = ["\n", "."]

TASKS = {
    "tiny_mc": """output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
  - metric: acc_norm
""",
    "tiny_ppl": """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""",
    "tiny_gen": """output_type: generate_until
doc_to_text: "{{prompt}}"
doc_to_target: "{{target}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 12
metric_list:
  - metric: exact_match
""",
}


def write_tasks(folder):
    """One YAML and one JSON-lines file per task, as a user writes a local harness task."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, docs in (("tiny_mc", MC_DOCS), ("tiny_ppl", PPL_DOCS), ("tiny_gen", GEN_DOCS)):
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        head = f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        (folder / f"{name}.yaml").write_text(head + TASKS[name])
    return folder


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from gptlab.tasks.gpt import run

    root = tmp_path_factory.mktemp("harness")
    run_dir = root / "run"
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[*TINY_RUN, f"paths.root_dir={root}", f"paths.output_dir={run_dir}"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run(cfg)
    finally:
        torch.set_num_threads(threads)
    return root, run_dir


@pytest.fixture(scope="module")
def evaluated(trained):
    """scripts/evaluate.py on the run, as a user types it."""
    root, run_dir = trained
    tasks = write_tasks(root / "tasks")
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "evaluate.py"),
            str(run_dir),
            "tasks=tiny_mc,tiny_ppl,tiny_gen",
            "batch_size=3",
            "bootstrap_iters=100",
            "--include-path",
            str(tasks),
            "--log-samples",
        ],
        cwd=root,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = run_dir / "eval_harness"
    samples = {task: strict_json_lines(out / f"samples_{task}.jsonl") for task in TASKS}
    return strict_json(out / "results.json"), samples, proc.stdout


# ---- the direct computation -------------------------------------------------------------------


@torch.no_grad()
def logprob_of(model, context: list[int], continuation: list[int]) -> float:
    """log p(continuation | context) in one forward pass over the last CONTEXT + 1 tokens (the model's
    window, as every harness model truncates)."""
    ids = torch.tensor([(context + continuation)[-(CONTEXT + 1) :]])
    logits, _ = model(ids[:, :-1])
    logprobs = F.log_softmax(logits[0].double(), dim=-1)
    targets = ids[0, 1:]
    return float(logprobs[torch.arange(len(targets)), targets][-len(continuation) :].sum())


def document_logprob(model, tokens: list[int], eot: int, window: int) -> float:
    """A document's log-likelihood in disjoint windows of the model's context: window k predicts tokens
    [k*window, (k+1)*window) from the tokens just before them (the first from <|endoftext|>); the last
    window sees a full context."""
    total, start, s = 0.0, 0, [eot] + tokens  # s[j] is the input that predicts tokens[j]
    while start < len(tokens):
        end = min(start + window, len(tokens))
        total += logprob_of(model, s[max(0, end - window) : start + 1], tokens[start:end])
        start = end
    return total


def test_multiple_choice_matches_the_model(trained, evaluated):
    _, run_dir = trained
    results, samples, stdout = evaluated
    model, tok = (lambda r: (r.model, r.tokenizer))(load_run(run_dir))
    correct = correct_norm = 0
    for doc, sample in zip(MC_DOCS, samples["tiny_mc"]):
        context = tok.encode(doc["question"])
        direct = [logprob_of(model, context, tok.encode(" " + c)) for c in doc["choices"]]
        harness_lls = [r[0] for r in sample["filtered_resps"]]
        assert harness_lls == pytest.approx(direct, abs=1e-4)
        correct += max(range(len(direct)), key=direct.__getitem__) == doc["answer"]
        normed = [ll / len(c) for ll, c in zip(direct, doc["choices"])]
        correct_norm += max(range(len(normed)), key=normed.__getitem__) == doc["answer"]
    assert results["results"]["tiny_mc"]["acc,none"] == pytest.approx(correct / len(MC_DOCS), abs=1e-4)
    assert results["results"]["tiny_mc"]["acc_norm,none"] == pytest.approx(
        correct_norm / len(MC_DOCS), abs=1e-4
    )
    assert isinstance(results["results"]["tiny_mc"]["acc_stderr,none"], float)
    assert results["metrics"]["harness/tiny_mc/acc"] == results["results"]["tiny_mc"]["acc,none"]
    assert "tiny_mc" in stdout and "acc_norm" in stdout


def test_rolling_perplexity_matches_the_model_over_windows(trained, evaluated):
    _, run_dir = trained
    results, samples, _ = evaluated
    trained_run = load_run(run_dir)
    model, tok = trained_run.model, trained_run.tokenizer
    assert results["max_length"] == CONTEXT == trained_run.train_context
    assert results["out_of_vocabulary"] == {"dropped_chars": 0, "unk_chars": 0, "unk_words": 0}
    totals = []
    for doc, sample in zip(PPL_DOCS, samples["tiny_ppl"]):
        tokens = tok.encode(doc["text"])
        totals.append(document_logprob(model, tokens, tok.eot_id, CONTEXT))
        assert sample["filtered_resps"][0] == pytest.approx(totals[-1], abs=1e-4)
    assert len(tok.encode(PPL_DOCS[2]["text"])) > 5 * CONTEXT  # the long document spans several windows
    words = sum(len(re.split(r"\s+", d["text"])) for d in PPL_DOCS)
    n_bytes = sum(len(d["text"].encode("utf-8")) for d in PPL_DOCS)
    got = results["results"]["tiny_ppl"]
    assert math.log(got["word_perplexity,none"]) == pytest.approx(-sum(totals) / words, abs=1e-4)
    assert math.log(got["byte_perplexity,none"]) == pytest.approx(-sum(totals) / n_bytes, abs=1e-4)
    assert got["bits_per_byte,none"] == pytest.approx(-sum(totals) / n_bytes / math.log(2), abs=1e-4)


def test_generation_matches_greedy_decoding_and_stops(trained, evaluated):
    _, run_dir = trained
    _, samples, _ = evaluated
    model, tok = (lambda r: (r.model, r.tokenizer))(load_run(run_dir))
    for doc, sample in zip(GEN_DOCS, samples["tiny_gen"]):
        ids = torch.tensor([tok.encode(doc["prompt"])])
        text = tok.decode(model.generate(ids, 12, temperature=0.0)[0, ids.size(1) :].tolist())
        expected = harness.cut_at_stops(text, [*STOPS, "<|endoftext|>"])
        assert sample["filtered_resps"][0] == expected
        assert not any(s in expected for s in STOPS)


def test_results_are_logged_to_the_runs_own_wandb_run(trained, evaluated):
    _, run_dir = trained
    results, _, _ = evaluated
    logged = [read_run(p) for p in find_runs(run_dir / "wandb")]
    train_id = next(r.run_id for r in logged if r.job_type == "train")
    resumed = [r for r in logged if r.run_id == train_id and "harness/tiny_mc/acc" in r.summary]
    assert len(resumed) == 1 and results["wandb_run"].endswith(train_id)
    for key, value in results["metrics"].items():
        assert resumed[0].summary[key] == pytest.approx(value)
    tables = [row for row in resumed[0].history if "harness/table/_type" in row]
    assert len(tables) == 1 and tables[0]["harness/table/_type"] == "table-file"


def test_a_diverged_models_scores_are_written_as_nan_in_strict_json(trained, tmp_path):
    """The harness on a model holding a NaN weight (as a diverged run leaves it): results.json and the
    samples are strict JSON, its log-likelihoods and perplexities "nan", its accuracy a number; the table
    printed from the record shows nan."""
    from lm_eval.utils import make_table

    root, run_dir = trained
    diverged = load_run(run_dir)
    with torch.no_grad():
        diverged.model.transformer.wte.weight[5, 0] = math.nan
    record, path = harness.evaluate(
        diverged,
        ["tiny_mc", "tiny_ppl"],
        include_path=str(write_tasks(tmp_path / "tasks")),
        log_samples=True,
        out_dir=tmp_path / "out",
        use_wandb=False,
        bootstrap_iters=0,
    )
    written = strict_json(path)
    assert written["results"]["tiny_ppl"]["word_perplexity,none"] == "nan"
    assert written["metrics"]["harness/tiny_ppl/bits_per_byte"] == "nan"
    assert isinstance(written["results"]["tiny_mc"]["acc,none"], float)
    assert written["results"]["tiny_mc"]["alias"] == "tiny_mc"  # text kept as text
    for task in ("tiny_mc", "tiny_ppl"):
        rows = strict_json_lines(tmp_path / "out" / f"samples_{task}.jsonl")
        assert len(rows) == len(MC_DOCS if task == "tiny_mc" else PPL_DOCS)
    assert strict_json_lines(tmp_path / "out" / "samples_tiny_ppl.jsonl")[0]["filtered_resps"] == ["nan"]
    assert math.isnan(record["metrics"]["harness/tiny_ppl/word_perplexity"])  # the record keeps its floats
    assert "|  NaN|" in make_table(record)


def test_batches_give_the_numbers_of_one_request_at_a_time(trained):
    from lm_eval.api.instance import Instance

    _, run_dir = trained
    requests = [
        ("The class", " is"),
        ("x", " = 1"),
        ("import sys and", " os"),
        ("", "Hello"),
        ("a" * 50, " b"),
    ]
    loglik = [Instance("loglikelihood", {}, r, i) for i, r in enumerate(requests)]
    prompts = ["def f", "class", "ab cd", "The value of x"]  # two of 5 characters: one shared batch
    gen = [
        Instance("generate_until", {}, (p, {"until": ["\n"], "max_gen_toks": 6}), i)
        for i, p in enumerate(prompts)
    ]
    one = harness.GptlabLM(run=run_dir, batch_size=1)
    many = harness.GptlabLM(run=run_dir, batch_size=4)
    for a, b in zip(one.loglikelihood(loglik), many.loglikelihood(loglik)):
        assert a[0] == pytest.approx(b[0], abs=1e-5) and a[1] == b[1]
    assert one.generate_until(gen) == many.generate_until(gen)


def test_bad_requests_are_refused_clearly(trained, tmp_path):
    from gptlab.errors import ConfigError

    _, run_dir = trained
    with pytest.raises(ConfigError, match=r"max_length=64 is past the 32-position table of pos=learned"):
        harness.GptlabLM(run=run_dir, max_length=64)
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "evaluate.py"),
            str(run_dir),
            "tasks=no_such_task",
            "--no-wandb",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "Unknown harness task(s) ['no_such_task']" in proc.stderr
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "evaluate.py"), str(run_dir), "task=tiny_mc"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "'task=tiny_mc' is not an option" in proc.stderr


def test_the_harness_command_line_runs_the_gptlab_model(trained, evaluated, tmp_path):
    root, run_dir = trained
    results, _, _ = evaluated
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gptlab.evaluation.harness",
            "run",
            "--model",
            "gptlab",
            "--model_args",
            f"run={run_dir}",
            "--tasks",
            "tiny_mc",
            "--include_path",
            str(root / "tasks"),
            "--output_path",
            str(tmp_path),
        ],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (written,) = tmp_path.rglob("results_*.json")
    got = json.loads(written.read_text())["results"]["tiny_mc"]
    assert got["acc,none"] == results["results"]["tiny_mc"]["acc,none"]
