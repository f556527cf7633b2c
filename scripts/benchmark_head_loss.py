"""Time and measure the output layer + cross-entropy, forward and backward, on CPU: the plain path (whole
logits, then ``F.cross_entropy``), gptlab's ``ChunkedLinearCrossEntropy`` (src/gptlab/model/head_loss.py) and
torch's ``F.linear_cross_entropy`` with ``nn.LinearCrossEntropyOptions(batch_chunk_size=...)``. ``--fused`` adds
``ours-fused``: ``ChunkedLinearCrossEntropy`` with each chunk's elementwise work as one kernel compiled by
``torch.compile`` (C++ on a CPU; the path ``loss.impl=chunked`` takes on CUDA in bf16), at the same chunk sizes
as ours; its compile (seconds to tens of seconds) falls in the warm-up call and in no timing.

    python scripts/benchmark_head_loss.py --quick                    # 4 min of CPU time
    python scripts/benchmark_head_loss.py --json head_loss.json      # the full grid (an hour on 2 busy cores)
    python scripts/benchmark_head_loss.py --shapes default --torch-chunks 128 160 256 --ours-chunks 256
    python scripts/benchmark_head_loss.py --shapes default --threads 1 --clock cpu --no-memory
    python scripts/benchmark_head_loss.py --shapes custom --custom 2048 256 --fused --ours-chunks --torch-chunks --no-memory

Shapes (rows N = batch x context, width D, vocabulary V):

- ``default``: the default run's head (conf/model/tiny.yaml n_embd and block_size, conf/data/default.yaml
  batch_size, the GPT-2 tokenizer of conf/train.yaml: V = 50,257);
- ``gpt2-small``: D = 768, N = 8 x 1024 (``--quick``: 1 x 1024), V = 50,257;
- ``custom``: ``--custom N D``, V = 50,257.

What is measured:

- time: one forward + backward of the loss (gradients of the hidden states and of the weight), the cases
  interleaved in one process, each round in a rotated order, after one warm-up call each. The table gives
  the median over rounds, and the median over rounds of each case's ratio to ``plain``, to ``ours`` at its
  default chunk (``/ours``) and, for torch's and ours-fused, to ``ours`` at the same chunk size (``/ours@c``), each
  measured in the same round (steadier than a ratio of medians on a shared machine). ``--threads 1 --clock
  cpu`` times this process's CPU time instead: the work, little disturbed by other jobs on the cores;
- faults: minor page faults per call in the timing process (``getrusage``), the cost of freeing blocks
  larger than glibc's mmap threshold and touching fresh ones next call;
- peak: the RSS high-water mark (``VmHWM`` of /proc/self/status, reset through /proc/self/clear_refs) over
  two calls, less the RSS with the inputs made, in a fresh subprocess per case. It counts what the calls
  leave allocated (the hidden and weight gradients: the same for every case) and whatever the allocator
  keeps, which is what the machine sees; torch has no CPU allocator statistics to read instead;
- gradient agreement: the largest absolute difference of the loss and of each gradient from ``plain``'s,
  all in fp32.

Torch's default options (no chunk size) pick tiny chunks on CPU fp32 (2 rows at the default shape: 80 s
against 2 s at 160 rows): ``--torch-default`` adds that case.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gptlab.model.head_loss import ChunkedLinearCrossEntropy, default_chunk_rows, plain_linear_cross_entropy
from gptlab.runs.jsonfile import all_figures_as_json, write_json

ROOT = Path(__file__).resolve().parents[1]
GPT2_VOCAB = 50257
LossFn = Callable[[Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class Shape:
    name: str
    rows: int  # N = batch x context
    width: int  # D
    vocab: int  # V


@dataclass(frozen=True)
class Case:
    impl: str  # plain, ours, ours-fused, torch, torch-default
    chunk: int | None  # rows per chunk; None: the implementation's own choice

    @property
    def name(self) -> str:
        if self.impl == "plain":
            return "plain"
        if self.impl == "torch-default":
            return "torch (default options)"
        return f"{self.impl} ({self.chunk})"


def default_shape() -> Shape:
    """The head of ``python train.py``: read from the config files it composes."""
    from omegaconf import OmegaConf

    train = OmegaConf.load(ROOT / "conf/train.yaml")
    choices: dict[str, str] = {}
    for item in OmegaConf.to_container(train.defaults):  # "_self_", then {group: choice} items
        if isinstance(item, dict):
            choices.update(item)
    tokenizer = choices.get("tokenizer")
    if tokenizer != "gpt2":
        raise SystemExit(
            f"conf/train.yaml's tokenizer is {tokenizer!r}: this script assumes GPT-2's vocabulary"
        )
    model = OmegaConf.load(ROOT / f"conf/model/{choices['model']}.yaml")
    data = OmegaConf.load(ROOT / f"conf/data/{choices['data']}.yaml")
    return Shape("default", int(data.batch_size) * int(model.block_size), int(model.n_embd), GPT2_VOCAB)


def loss_fn(case: Case) -> LossFn:
    if case.impl == "plain":
        return lambda h, w, t: plain_linear_cross_entropy(h, w, t)
    if case.impl in ("ours", "ours-fused"):
        fused = case.impl == "ours-fused"
        return lambda h, w, t: ChunkedLinearCrossEntropy.apply(
            h, w, None, t, -1, case.chunk, True, 0.0, None, None, fused
        )[0]
    options = nn.LinearCrossEntropyOptions(batch_chunk_size=case.chunk)  # chunk None: torch's default pick
    return lambda h, w, t: F.linear_cross_entropy(h, w, t, ignore_index=-1, options=options)


def make_inputs(shape: Shape, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Hidden states ~ N(0, 1) (after the final norm), weight ~ N(0, 0.02) (the model's init), targets uniform."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(shape.rows, shape.width, generator=g).requires_grad_()
    weight = torch.randn(shape.vocab, shape.width, generator=g).mul_(0.02).requires_grad_()
    targets = torch.randint(0, shape.vocab, (shape.rows,), generator=g)
    return hidden, weight, targets


def step(fn: LossFn, hidden: Tensor, weight: Tensor, targets: Tensor) -> Tensor:
    hidden.grad = weight.grad = None
    loss = fn(hidden, weight, targets)
    loss.backward()
    return loss.detach()


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def status_kib(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))


def child_peak(shape: Shape, case: Case) -> dict[str, float]:
    """In this (fresh) process: the RSS high-water mark over two calls, above the RSS with the inputs made."""
    hidden, weight, targets = make_inputs(shape)
    fn = loss_fn(case)
    if case.impl == "ours-fused":  # the compile's memory is not the head's: compiled before the measure
        step(fn, hidden, weight, targets)
        hidden.grad = weight.grad = None
    gc.collect()
    base = status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    step(fn, hidden, weight, targets)
    step(fn, hidden, weight, targets)
    return {"peak_mib": (status_kib("VmHWM") - base) / 1024, "rss_before_mib": base / 1024}


def measure_peak(shape: Shape, case: Case) -> float | None:
    spec = json.dumps({"shape": asdict(shape), "case": asdict(case)})
    done = subprocess.run(
        [sys.executable, __file__, "--child", spec], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        print(f"  peak of {case.name} failed: {done.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])["peak_mib"]


def max_abs_diff(a: Tensor, b: Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def run_shape(
    shape: Shape, cases: list[Case], repeats: int, memory: bool, clock: Callable[[], float]
) -> list[dict]:
    hidden, weight, targets = make_inputs(shape)
    fns = {case: loss_fn(case) for case in cases}
    results: dict[Case, dict] = {
        case: {"times": [], "faults": [], "ratio_plain": [], "ratio_ours": [], "ratio_same": []}
        for case in cases
    }
    reference = None
    for case in cases:  # warm-up, and the gradients to compare
        loss = step(fns[case], hidden, weight, targets)
        got = (loss, hidden.grad.clone(), weight.grad.clone())
        if case.impl == "plain":
            reference = got
        results[case]["got"] = got
    assert reference is not None
    for case in cases:
        loss, gh, gw = results[case].pop("got")
        results[case].update(
            loss=loss.item(),
            loss_diff=max_abs_diff(loss, reference[0]),
            grad_hidden_diff=max_abs_diff(gh, reference[1]),
            grad_weight_diff=max_abs_diff(gw, reference[2]),
        )
    plain = Case("plain", None)
    ours = next((c for c in cases if c.impl == "ours" and c.chunk == default_chunk_rows(shape.vocab)), None)
    for r in range(repeats):
        order = cases[r % len(cases) :] + cases[: r % len(cases)]
        this_round = {}
        for case in order:
            gc.collect()
            faults = minor_faults()
            start = clock()
            step(fns[case], hidden, weight, targets)
            this_round[case] = clock() - start
            results[case]["faults"].append(minor_faults() - faults)
        for case in cases:
            results[case]["times"].append(this_round[case])
            results[case]["ratio_plain"].append(this_round[case] / this_round[plain])
            if ours is not None:
                results[case]["ratio_ours"].append(this_round[case] / this_round[ours])
            same = Case("ours", case.chunk)  # ours at the same chunk size, when measured
            if case.impl in ("torch", "ours-fused") and same in this_round:
                results[case]["ratio_same"].append(this_round[case] / this_round[same])
        print(
            f"  round {r + 1}/{repeats}: " + ", ".join(f"{c.name} {this_round[c] * 1e3:.0f}" for c in cases),
            flush=True,
        )
    del hidden, weight, targets
    gc.collect()
    rows = []
    for case in cases:
        res = results[case]
        rows.append(
            {
                "case": case.name,
                "impl": case.impl,
                "chunk": case.chunk,
                "median_ms": statistics.median(res["times"]) * 1e3,
                "times_ms": [t * 1e3 for t in res["times"]],
                "ratio_to_plain": statistics.median(res["ratio_plain"]),
                "ratio_to_ours": statistics.median(res["ratio_ours"]) if res["ratio_ours"] else None,
                # torch's against ours at the same chunk size (when measured)
                "ratio_to_ours_same_chunk": statistics.median(res["ratio_same"])
                if res["ratio_same"]
                else None,
                "minor_faults_per_call": statistics.median(res["faults"]),
                "peak_mib": measure_peak(shape, case) if memory else None,
                "loss": res["loss"],
                "loss_diff": res["loss_diff"],
                "grad_hidden_diff": res["grad_hidden_diff"],
                "grad_weight_diff": res["grad_weight_diff"],
            }
        )
    return rows


def print_table(shape: Shape, rows: list[dict], repeats: int, clock: Callable[[], float]) -> None:
    print(
        f"\n{shape.name}: N={shape.rows} D={shape.width} V={shape.vocab}, fp32, {torch.get_num_threads()} threads, "
        f"median of {repeats} interleaved rounds ({'wall' if clock is time.perf_counter else 'CPU'} time)"
    )
    head = (
        f"{'case':24s} {'ms':>9s} {'/plain':>7s} {'/ours':>7s} {'/ours@c':>7s} {'peak MiB':>9s} {'faults':>8s} "
        f"{'|dloss|':>8s} {'|dgrad h|':>9s} {'|dgrad W|':>9s}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        peak = f"{r['peak_mib']:9.0f}" if r["peak_mib"] is not None else f"{'-':>9s}"
        vs_ours, vs_same = (
            f"{r[key]:7.3f}" if r[key] is not None else f"{'-':>7s}"
            for key in ("ratio_to_ours", "ratio_to_ours_same_chunk")
        )
        print(
            f"{r['case']:24s} {r['median_ms']:9.1f} {r['ratio_to_plain']:7.3f} {vs_ours} {vs_same} {peak} "
            f"{r['minor_faults_per_call']:8.0f} {r['loss_diff']:8.1e} {r['grad_hidden_diff']:9.1e} "
            f"{r['grad_weight_diff']:9.1e}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="3 rounds, GPT-2 small at N=1024, torch's at 160/512/1024 rows and ours at 160/512",
    )
    parser.add_argument(
        "--shapes",
        nargs="+",
        default=["default", "gpt2-small"],
        choices=["default", "gpt2-small", "custom"],
    )
    parser.add_argument(
        "--custom",
        nargs=2,
        type=int,
        metavar=("N", "D"),
        default=None,
        help="the custom shape's rows and width",
    )
    parser.add_argument(
        "--fused", action="store_true", help="add ours-fused at each of ours' chunk sizes (compiles once)"
    )
    parser.add_argument(
        "--gpt2-rows", type=int, default=None, help="N of gpt2-small (default 8192; --quick 1024)"
    )
    parser.add_argument(
        "--torch-chunks", nargs="*", type=int, default=None, help="default 64 160 512 1024 2048 (none: none)"
    )
    parser.add_argument(
        "--ours-chunks",
        nargs="*",
        type=int,
        default=None,
        help="ours at these chunk sizes too (default 512 1024)",
    )
    parser.add_argument("--torch-default", action="store_true", help="add torch's default options (slow)")
    parser.add_argument("--repeats", type=int, default=None, help="rounds (default 7; --quick: 3)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: this process's CPU time, steadier than wall time on a shared machine (with --threads 1: "
        "with more threads it also counts their spin-waiting)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        spec = json.loads(args.child)
        print(json.dumps(child_peak(Shape(**spec["shape"]), Case(**spec["case"]))))
        return

    repeats = args.repeats or (3 if args.quick else 7)
    if args.torch_chunks is None:
        args.torch_chunks = [160, 512, 1024] if args.quick else [64, 160, 512, 1024, 2048]
    if args.ours_chunks is None:
        args.ours_chunks = [512] if args.quick else [512, 1024]
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    report = {
        "command": " ".join(["python", *sys.argv]),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "clock": args.clock,
        "cpu": platform.processor() or platform.machine(),
        "repeats": repeats,
        "shapes": [],
    }
    for name in args.shapes:
        if name == "default":
            shape = default_shape()
        elif name == "custom":
            if args.custom is None:
                parser.error("--shapes custom needs --custom N D")
            shape = Shape("custom", args.custom[0], args.custom[1], GPT2_VOCAB)
        else:
            rows = args.gpt2_rows or (1 if args.quick else 8) * 1024
            shape = Shape("gpt2-small", rows, 768, GPT2_VOCAB)
        ours_default = default_chunk_rows(shape.vocab)
        cases = [Case("plain", None), Case("ours", ours_default)]
        cases += [
            Case("ours", c)
            for c in dict.fromkeys(min(c, shape.rows) for c in args.ours_chunks)
            if c != ours_default
        ]
        if args.fused:
            cases += [Case("ours-fused", c.chunk) for c in cases if c.impl == "ours"]
        cases += [Case("torch", c) for c in dict.fromkeys(min(c, shape.rows) for c in args.torch_chunks)]
        if args.torch_default:
            cases.append(Case("torch-default", None))
        print(f"{shape}: {', '.join(c.name for c in cases)}", flush=True)
        rows = run_shape(shape, cases, repeats, memory=not args.no_memory, clock=clock)
        print_table(shape, rows, repeats, clock)
        report["shapes"].append({**asdict(shape), "cases": rows})
    if args.json:
        write_json(args.json, all_figures_as_json(report))  # strict JSON (gptlab.runs.jsonfile), whole
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
