"""scripts/gpu_check.py, the one command a GPU session runs, tested here at toy size on the CPU: each section
measures and compares what it says, a section's failure or hang costs that section only, and the table shows
every section. (The figures themselves need the GPU; the whole smoke run is ``--cpu-smoke``.)"""

from __future__ import annotations

import math
import sys

import pytest
from conftest import load_script, strict_json

from gptlab import torch_features


@pytest.fixture(scope="module")
def gpu_check():
    yield load_script("gpu_check")
    del sys.modules["gpu_check"]


@pytest.fixture(scope="module")
def smoke(gpu_check, tmp_path_factory):
    """The measuring sections at toy size on the CPU, in this process (gpt2 without its compiled variant:
    compiling takes tens of seconds on a CPU)."""
    ctx = gpu_check.Context(smoke=True, out=tmp_path_factory.mktemp("gpu_check"), with_compile=False)
    names = ("environment", "gpt2", "loss", "head_accuracy", "attention", "checkpoint_copy", "word2vec")
    return {name: gpu_check.run_section(name, ctx) for name in names}


def test_each_section_runs_at_toy_size(smoke):
    for name, result in smoke.items():
        assert result["status"] == "ok", (name, result.get("traceback") or result.get("error"))


def test_the_loss_section_holds_every_impl_to_the_fp32_reference(smoke):
    rows = {r["impl"]: r for r in smoke["loss"]["rows"]}
    assert list(rows) == [
        "plain",
        "chunked-fused",
        "chunked-eager",
        "torch",
        "liger",
        "cce",
        "chunked-fused (64 rows)",
        "chunked (64 rows)",
        "torch (64 rows)",
        "plain (padded to 1024)",
        "chunked-fused (padded to 1024)",
        "chunked-eager (padded to 1024)",
    ]
    # the fused pass compiles its kernel: not in this run without compiles (the next test runs it)
    for impl in ("chunked-fused", "chunked-fused (64 rows)"):
        assert rows[impl]["status"] == "not run: --no-compile (it compiles its kernel)"
    assert smoke["loss"]["chunked_takes"] == "eager"  # on a CPU loss.impl=chunked takes the eager pass
    # the output layer as the model stores it (toy vocabulary 1,000 padded to 1,024): the same numbers, and the
    # padding's rows get no gradient
    for impl in ("plain (padded to 1024)", "chunked-eager (padded to 1024)"):
        assert rows[impl]["status"] == "equal" and rows[impl]["padding_grad_max"] == 0.0, rows[impl]
    assert (
        rows["chunked-fused (padded to 1024)"]["status"] == "not run: --no-compile (it compiles its kernel)"
    )
    for impl in ("plain", "chunked-eager", "torch", "chunked (64 rows)", "torch (64 rows)"):
        if impl.startswith("torch") and not torch_features.has("linear_cross_entropy"):  # torch < 2.13
            assert rows[impl]["status"].startswith("not run: needs torch's chunked output layer")
            continue
        assert rows[impl]["status"] == "equal" and float(rows[impl]["grad_rel_error"]) < 1e-4
    for impl in ("liger", "cce"):  # CUDA kernels: named, with the reason, not silently left out
        assert rows[impl]["status"].startswith("not run: cannot run on cpu")
    assert smoke["loss"]["auto_chooses"] == "chunked" and smoke["loss"]["fastest"] in rows


def test_the_head_accuracy_section_sets_cut_cross_entropys_arithmetic_beside_the_heads_that_run(smoke):
    """On a CPU the heads that run here (plain, chunked) and Cut Cross-Entropy's arithmetic over two tile orders:
    that arithmetic's bf16 sums are the farthest from fp32 even at toy size (vocabulary 4,096: 32 tiles a row)."""
    rows = {r["impl"]: r for r in smoke["head_accuracy"]["rows"]}
    assert list(rows) == ["plain", "chunked", "cce (arithmetic) order 0", "cce (arithmetic) order 1"]
    largest = {impl: float(r["largest_error"]) for impl, r in rows.items()}
    assert max(largest["plain"], largest["chunked"]) < 2e-2
    assert min(largest["cce (arithmetic) order 0"], largest["cce (arithmetic) order 1"]) > largest["plain"]
    assert all(r["at"].startswith("transformer.") for r in rows.values())


def test_the_loss_sections_fused_row_compiles_and_equals_the_reference(gpu_check, tmp_path):
    """With compiles on, as on the GPU, the section times the chunked head's fused pass beside the eager one:
    compiled here to C++ (on the GPU to Triton), equal to the fp32 reference as the eager pass is."""
    ctx = gpu_check.Context(smoke=True, out=tmp_path)
    result = gpu_check.run_section("loss", ctx)
    assert result["status"] == "ok", result.get("traceback") or result.get("error")
    rows = {r["impl"]: r for r in result["rows"]}
    for impl in ("chunked-fused", "chunked-eager", "chunked-fused (64 rows)"):
        assert rows[impl]["status"] == "equal" and float(rows[impl]["grad_rel_error"]) < 1e-4, rows[impl]
        assert rows[impl]["ms_fwd_bwd"] > 0
    # the chunk each took: the default (on the CPU's budget the whole toy batch of 256 rows), or the one asked;
    # beside it what the memory plan counts for it
    assert [rows[i]["chunk_rows"] for i in ("chunked-fused", "chunked-fused (64 rows)")] == [256, 64]
    assert rows["chunked-fused"]["planned_gib"] > 0 and "planned_gib" not in rows["plain"]


def test_the_attention_section_compares_each_bias_scheme_across_the_two_routes(smoke):
    rows = smoke["attention"]["rows"]
    assert [(r["pos"], r["route"]) for r in rows] == [
        (pos, route) for pos in ("alibi", "relative", "fire") for route in ("flex", "sdpa")
    ]
    assert all(r["same_loss"] and r["tokens_per_s"] > 0 for r in rows)
    assert {r["ran"] for r in rows} == {"sdpa"}  # FlexAttention trains on CUDA only: the CPU takes SDPA
    # counted in the FlexAttention rows, after the SDPA row has compiled what else the step compiles (on CUDA
    # the chunked head's kernel): on CUDA at most 1 per FlexAttention row, here none
    assert [r["flex_compiles"] for r in rows] == [0, None] * 3


def test_the_gpt2_and_word2vec_sections_report_rates(smoke):
    (eager,) = smoke["gpt2"]["rows"]
    assert eager["variant"] == "eager" and eager["tokens_per_s"] > 0 and math.isfinite(eager["final_loss"])
    assert eager["mfu_percent"] is None  # no bf16 peak for a CPU
    rows = smoke["word2vec"]["rows"]
    # at toy size the CPU only (the GPU adds CUDA's row and its rate over the CPU's at each batch size)
    assert [(r["device"], r["batch_size"]) for r in rows] == [("cpu", 256), ("cpu", 1024)]
    for row in rows:
        assert row["words_per_s"] > 0 and row["words"] > 0 and math.isfinite(row["final_loss"]), row


def test_the_checkpoint_copy_section_times_a_saves_wait_into_each_kind_of_buffer(smoke):
    """The copy a background save makes the step wait for, into pageable and into pinned buffers, both equal to
    the state they copied; without CUDA nothing is pinned (only CUDA tensors' buffers are)."""
    pageable, pinned = smoke["checkpoint_copy"]["rows"]
    assert (pageable["buffers"], pinned["buffers"]) == ("pageable", "pinned")
    for row in (pageable, pinned):
        assert row["same_bytes"] is True and row["checkpoint_mb"] > 0 and row["wait_per_save_ms"] > 0
        assert row["pinned_mb"] == 0.0  # a CPU's tensors


def test_a_compiled_steps_profile_names_where_its_time_goes(gpu_check):
    """The profile the gpt2 section keeps of each compiled step (here of a CPU step that is almost all one
    matrix product): operations by their own time, per step and as a share, and its table in the report."""
    import torch

    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)

    def step() -> None:  # 2 GFLOP of product against a sum over its million entries
        (a @ b).sum()

    rows = gpu_check._profile(step, torch.device("cpu"), calls=3)
    assert rows[0]["kernel"] in ("aten::mm", "aten::matmul") and rows[0]["calls_per_step"] == 1
    assert rows[0]["percent"] > 50 and sum(r["percent"] for r in rows) <= 100.5
    assert all(r["ms_per_step"] >= 0 for r in rows)
    table = gpu_check.markdown({"gpt2": {"status": "ok", "seconds": 1.0, "profiles": {"compile": rows}}})
    assert "Profile of a step, compile: its operations by their own time" in table
    assert f"| {rows[0]['kernel']} | {rows[0]['ms_per_step']} |" in table


def test_the_table_shows_every_section_and_its_status(gpu_check, smoke):
    table = gpu_check.markdown(smoke)
    for name in smoke:
        assert f"## {name}: ok (" in table
    assert "| impl | status | ms_fwd_bwd |" in table and "auto_chooses: chunked" in table


def test_the_report_is_strict_json_with_a_nan_figure_and_a_missing_one(gpu_check, smoke, tmp_path):
    """gpu_check.json parses strictly: a step's NaN loss (a run that diverged on the GPU) is "nan", the CPU's
    MFU (no bf16 peak) null; gpu_check.md is written beside it."""
    (row,) = smoke["gpt2"]["rows"]
    results = {**smoke, "gpt2": {**smoke["gpt2"], "rows": [{**row, "final_loss": math.nan}]}}
    gpu_check.write_report(results, tmp_path)
    (saved,) = strict_json(tmp_path / "gpu_check.json")["gpt2"]["rows"]
    assert saved["final_loss"] == "nan" and saved["mfu_percent"] is None
    assert "## gpt2: ok (" in (tmp_path / "gpu_check.md").read_text()


def test_a_section_that_raises_is_reported_and_the_others_go_on(gpu_check, tmp_path, monkeypatch):
    def broken(ctx):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(gpu_check, "SECTIONS", [gpu_check.Section("broken", 5, broken)])
    result = gpu_check.run_section("broken", gpu_check.Context(smoke=True, out=tmp_path))
    assert result["status"] == "error" and "illegal memory access" in result["error"]
    assert "## broken: error" in gpu_check.markdown({"broken": result})


def test_a_section_runs_in_a_child_process_stopped_at_its_time_limit(gpu_check, tmp_path):
    ctx = gpu_check.Context(smoke=True, out=tmp_path)
    section = next(s for s in gpu_check.SECTIONS if s.name == "environment")
    done = gpu_check.run_in_child(section, ctx, budget_s=120)
    assert done["status"] == "ok" and done["info"]["device"] == "cpu (smoke)"
    stopped = gpu_check.run_in_child(section, ctx, budget_s=0.5)  # far too little: the child is killed
    assert stopped == {"status": "timeout", "error": "stopped after its 0.5 s", "seconds": 0.5}


def test_the_limits_fit_the_gpu_session_and_a_hang_costs_only_its_own_section(gpu_check):
    limits = [s.budget_s for s in gpu_check.SECTIONS]
    # the whole command, the wheels' install included, ends within 8 minutes, with room for the install
    assert sum(limits) + 15 <= gpu_check.WHOLE_RUN_S < 8 * 60

    def run(taken: dict[int, float], total: float) -> list[float]:
        """Each section's budget when section i takes taken[i] seconds, and every other hangs to its end."""
        left, budgets = total, []
        for i in range(len(limits)):
            budget = gpu_check.section_budget(limits[i:], left)
            budgets.append(budget)
            left -= min(budget, taken.get(i, budget))
        return budgets

    assert run({}, sum(limits)) == limits  # all hang: each its own limit, nothing more
    # environment ends in 10 s: gpu_tests may take the 20 s it left too, and then hangs: the rest keep theirs
    assert run({0: 10}, sum(limits))[1:] == [limits[1] + limits[0] - 10, *limits[2:]]
    # the install took time out of the whole: every section loses its proportional share
    shares = run({}, sum(limits) - 45)
    assert shares == pytest.approx([x * (1 - 45 / sum(limits)) for x in limits])


@pytest.mark.slow
def test_the_strategies_section_resumes_ddp_and_fsdp_to_the_uninterrupted_loss(gpu_check, tmp_path):
    """strategy=ddp and strategy=fsdp on one CPU process (gloo): real train.py runs, one interrupted at its
    middle checkpoint and resumed, compared row by row with the uninterrupted run (the GPU session's check of
    resume over NCCL, at toy size)."""
    ctx = gpu_check.Context(smoke=True, out=tmp_path, with_compile=False)
    result = gpu_check.run_section("strategies", ctx)
    assert result["status"] == "ok", result.get("traceback") or result.get("error") or result.get("rows")
    rows = {r["strategy"]: r for r in result["rows"]}
    assert set(rows) == {"ddp", "fsdp"}
    for row in rows.values():
        assert row["same_loss"] is True and row["val_loss_resumed"] == row["val_loss_uninterrupted"], row
    assert rows["fsdp"]["checkpoint"] == "directory (sharded)"


@pytest.mark.slow
def test_the_main_command_section_times_a_step_from_two_whole_processes(gpu_check, tmp_path):
    """The README's main command, run as a user runs it (every default but the step count, toy-sized on a CPU):
    two processes, their final losses, and a step's wall time from the difference of the two; with
    ``--foreground-save`` a third, whose checkpoints are written before the next step."""
    ctx = gpu_check.Context(smoke=True, out=tmp_path, with_compile=False, foreground_save=True)
    result = gpu_check.run_section("main_command", ctx)
    assert result["status"] == "ok", result.get("traceback") or result.get("error") or result.get("rows")
    first, second, foreground, per_step, per_save = result["rows"]
    assert (
        first["command"] == "python train.py model=small pos=sinusoidal trainer.devices=1 trainer.max_steps=4"
    )
    assert second["command"].endswith("trainer.max_steps=12")
    assert foreground["command"].endswith("callbacks.last_checkpoint.background=false trainer.max_steps=12")
    assert first["loss_impl"] == second["loss_impl"] == foreground["loss_impl"] == "chunked"
    assert first["compile"] == second["compile"] == foreground["compile"] == "off"  # compile=auto on a CPU
    assert 0 < second["final_val_loss"] < first["final_val_loss"]  # the longer run trained further
    # where the checkpoints are written changes nothing trained (on a CPU, bit for bit)
    assert foreground["final_val_loss"] == second["final_val_loss"]
    # a step's time is the difference of the two processes' wall times over their 8 steps: at toy size that can
    # be below the start-ups' variation on a busy machine (negative), so the figure is checked as arithmetic
    assert per_step["step_ms"] == pytest.approx((second["wall_s"] - first["wall_s"]) / 8 * 1e3, abs=0.1)
    if per_step["step_ms"] > 0:
        assert per_step["tokens_per_s"] == pytest.approx(
            result["tokens_per_step"] / (per_step["step_ms"] / 1e3), rel=0.01
        )
    assert per_save["command"].endswith("(3 saves)") and isinstance(per_save["save_ms"], float)


def test_the_gpu_tests_section_takes_every_file_with_a_cuda_case(gpu_check):
    """Files parametrized over conftest's list of a CPU and a CUDA case have gpu tests without the marker in
    their text: the Mixture of Experts compiled by inductor, multi-token prediction through each output kernel,
    FlexAttention's decoding compile. The section runs them; it leaves out files with no gpu test."""
    files = gpu_check.gpu_test_files()
    for name in ("test_gpu.py", "test_moe.py", "test_mtp.py", "test_flex_compile.py", "test_head_loss.py"):
        assert f"tests/{name}" in files, files
    assert "tests/test_gpu_check.py" not in files and "tests/test_docs.py" not in files
