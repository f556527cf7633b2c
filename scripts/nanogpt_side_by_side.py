"""gptlab's `train.py` against nanoGPT's `train.py` on the same tokens, shape and schedule.

    python scripts/nanogpt_side_by_side.py --nanogpt ~/src/nanoGPT              # speed: seconds per step
    python scripts/nanogpt_side_by_side.py --nanogpt ~/src/nanoGPT --loss --pairs 2 --steps 320

The corpus gptlab trains on by default (or `--data <path>`) is tokenized once with GPT-2's tokenizer and written
as nanoGPT's `train.bin`/`val.bin`; both programs then read those very files (gptlab reads a nanoGPT folder as
it is). Both train the default model's shape (2 layers, 4 heads, 128 wide, context 128, batch 8, tied head) with
AdamW (lr 4e-3, betas 0.9/0.95, weight decay 0.1, clip 1.0), 30 warmup steps and a cosine decay to 4e-4,
fp32, without compilation, on the same device. nanoGPT is given `--gradient_accumulation_steps=1` so that
one of its iterations is one optimizer step of 8 x 128 tokens, as gptlab's.

Speed (the default): each program is timed as a whole process from outside, at `--short` and `--long` steps,
evaluating only at its start (nanoGPT, over one batch) and end (both): start-up, data, the evaluations and
the last checkpoint are in both runs and cancel, so `(wall_long - wall_short) / (long - short)` is the wall time of one
training step, and 1,024 tokens over it the rate. The processes are interleaved (all short runs, then all long
runs, the order rotating each round) after an untimed run of each; `scripts/benchmark.py --per-step` does the
timing. Prints each process's wall time, the medians and ranges, gptlab's rate over nanoGPT's round by round,
one JSON object and last a Markdown table to paste.

Loss (`--loss`): `--pairs` pairs of full runs of `--steps` steps, run in turn, with each program's whole wall
time and final validation loss, for both measured as gptlab measures it (every token of windows tiling the
validation split; nanoGPT's final checkpoint is re-evaluated so, and its own estimate over `--eval-iters`
random batches is printed beside). The two programs draw their training batches differently: nanoGPT takes
windows at random offsets, gptlab shuffles windows that start every `data.stride` tokens (by default its
context): pass `data.stride=1` to draw from every offset as nanoGPT does. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/benchmark.py times per step

ROOT = Path(__file__).resolve().parents[1]
SHAPE = {"n_layer": 2, "n_head": 4, "n_embd": 128, "block_size": 128, "batch_size": 8}
SCHEDULE = {"learning_rate": 4e-3, "min_lr": 4e-4, "warmup_iters": 30, "weight_decay": 0.1, "beta2": 0.95}


def export_tokens(data: str | None, folder: Path) -> tuple[int, int]:
    """The corpus's GPT-2 tokens as nanoGPT's flat uint16 files in ``folder``; returns the split sizes."""
    import numpy as np

    from gptlab.data.corpus import DataSpec, prepare

    prepared = prepare(DataSpec(path=data) if data else DataSpec(), "gpt2")
    folder.mkdir(parents=True, exist_ok=True)
    sizes = []
    for split, tokens in (("train", prepared.train), ("val", prepared.val)):
        array = tokens.array().astype(np.uint16)
        array.tofile(folder / f"{split}.bin")
        sizes.append(len(array))
    return sizes[0], sizes[1]


def gptlab_overrides(data: Path, device: str, overrides: list[str]) -> list[str]:
    """gptlab's overrides for nanoGPT's token files, shape and device (its schedule is gptlab's default)."""
    return [
        f"data.path={data}",
        "tokenizer=gpt2",
        f"trainer.accelerator={device}",
        "logger=csv",
        *(f"model.{k}={v}" for k, v in SHAPE.items() if k != "batch_size"),
        f"data.batch_size={SHAPE['batch_size']}",
        *overrides,
    ]


def nanogpt_argv(
    data: Path, out: Path, steps: int, device: str, eval_iters: int, eval_interval: int, decay_steps: int
) -> list[str]:
    """nanoGPT's command line for ``steps`` iterations; its cosine decay ends at ``decay_steps``, which must
    be past the 30 warmup iterations (nanoGPT divides by their difference)."""
    flags = {
        **SHAPE,
        **SCHEDULE,
        "dataset": str(data),  # nanoGPT joins data/<dataset>: an absolute path stands for itself
        "out_dir": str(out),
        "gradient_accumulation_steps": 1,
        "max_iters": steps,
        "lr_decay_iters": decay_steps,
        "eval_interval": eval_interval,
        "eval_iters": eval_iters,
        "log_interval": 1,
        "dropout": 0.0,
        "bias": True,
        "device": device,
        "dtype": "float32",
        "compile": False,
    }
    return [sys.executable, "train.py", *(f"--{k}={v}" for k, v in flags.items())]


def nanogpt_name(nanogpt: Path) -> str:
    proc = subprocess.run(
        ["git", "-C", str(nanogpt), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return f"nanoGPT {proc.stdout.strip()}" if proc.returncode == 0 else "nanoGPT"


def gptlab_name() -> str:
    proc = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return f"gptlab {proc.stdout.strip()}" if proc.returncode == 0 else "gptlab"


# ---- speed: seconds per step from whole processes --------------------------------------------------------


def speed(args, data: Path, device: str) -> None:
    from benchmark import PerStepTiming, Program, gptlab_program, machine_description, per_step_report

    gptlab = gptlab_program(gptlab_name(), ROOT, gptlab_overrides(data, device, args.overrides))
    nano = Program(
        nanogpt_name(args.nanogpt),
        # Evaluations at the first iteration and the last only, over one batch: in both runs, so they cancel.
        # One schedule for both lengths (its decay ends with the long run), as the rate does not depend on it.
        lambda steps, out: nanogpt_argv(data, out, steps, args.device, 1, steps, args.long),
        args.nanogpt,
        SHAPE["batch_size"] * SHAPE["block_size"],
    )
    if gptlab.tokens_per_step != nano.tokens_per_step:
        raise SystemExit(
            f"gptlab trains {gptlab.tokens_per_step} tokens a step, nanoGPT {nano.tokens_per_step}: "
            "leave the batch and context as they are"
        )
    result = PerStepTiming(
        [gptlab, nano],
        args.short,
        args.long,
        args.rounds,
        args.out.resolve() / "per_step",
        warmup=not args.no_warmup,
    ).run()
    result["machine"] = machine_description()
    result["overrides"] = args.overrides
    print(json.dumps(result))
    print(per_step_report(result, shlex.join(["python", "scripts/nanogpt_side_by_side.py", *sys.argv[1:]])))


# ---- loss: full runs, the final validation loss of each ---------------------------------------------------


def run_gptlab(data: Path, out: Path, steps: int, device: str, overrides: list[str]) -> dict[str, float]:
    args = [*gptlab_overrides(data, device, overrides), f"trainer.max_steps={steps}", f"hydra.run.dir={out}"]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"gptlab's train.py failed:\n{proc.stderr[-3000:]}")
    final = json.loads((out / "result.json").read_text())["metrics"]["val/loss"]
    return {"wall_seconds": wall, "val_loss": final}


def tiled_val_loss(nanogpt: Path, out: Path, data: Path) -> float:
    """The validation loss of nanoGPT's final checkpoint measured as gptlab measures its own: over every token
    of windows that tile the validation split (stride = context), not over random batches."""
    import numpy as np
    import torch

    sys.path.insert(0, str(nanogpt))
    try:
        from model import GPT, GPTConfig  # nanoGPT's model.py
    finally:
        sys.path.remove(str(nanogpt))
    ckpt = torch.load(out / "ckpt.pt", map_location="cpu", weights_only=False)  # written by nanoGPT just now
    model = GPT(GPTConfig(**ckpt["model_args"]))
    model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()})
    model.eval()
    val = np.fromfile(data / "val.bin", dtype=np.uint16).astype(np.int64)
    T = SHAPE["block_size"]
    starts = range(0, len(val) - T, T)
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(starts), SHAPE["batch_size"]):
            idx = starts[i : i + SHAPE["batch_size"]]
            x = torch.tensor(np.stack([val[j : j + T] for j in idx]))
            y = torch.tensor(np.stack([val[j + 1 : j + T + 1] for j in idx]))
            _, loss = model(x, y)
            total, count = total + loss.item() * y.numel(), count + y.numel()
    return total / count


def run_nanogpt(
    nanogpt: Path, data: Path, out: Path, steps: int, device: str, eval_iters: int
) -> dict[str, float]:
    cmd = nanogpt_argv(data, out, steps, device, eval_iters, eval_interval=80, decay_steps=steps)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=nanogpt, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"nanoGPT's train.py failed:\n{proc.stderr[-3000:]}")
    vals = re.findall(r"^step (\d+): train loss [\d.]+, val loss ([\d.]+)", proc.stdout, re.M)
    return {
        "wall_seconds": wall,
        "val_loss": tiled_val_loss(nanogpt, out, data),
        "val_loss_own_estimate": float(vals[-1][1]),  # nanoGPT's: mean over --eval-iters random batches
    }


def loss(args, data: Path, device: str) -> None:
    out = args.out.resolve()
    rows: dict[str, list[dict[str, float]]] = {"gptlab": [], "nanoGPT": []}
    for pair in range(args.pairs):
        rows["gptlab"].append(run_gptlab(data, out / f"gptlab_{pair}", args.steps, device, args.overrides))
        print(f"pair {pair} gptlab:  {rows['gptlab'][-1]}", flush=True)
        rows["nanoGPT"].append(
            run_nanogpt(args.nanogpt, data, out / f"nanogpt_{pair}", args.steps, args.device, args.eval_iters)
        )
        print(f"pair {pair} nanoGPT: {rows['nanoGPT'][-1]}", flush=True)
    summary = {
        name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in rows.items()
    }
    print(
        f"\n| program ({args.pairs} alternated pairs, {args.steps} steps) | wall s (whole process) | final val loss |"
    )
    print("|---|---:|---:|")
    for name, s in summary.items():
        losses = ", ".join(f"{r['val_loss']:.4f}" for r in rows[name])
        print(f"| {name} | {s['wall_seconds']:.0f} | {s['val_loss']:.4f} ({losses}) |")
    own = summary["nanoGPT"]["val_loss_own_estimate"]
    print(
        f"\nnanoGPT's own estimate of its final validation loss ({args.eval_iters} random batches): {own:.4f}"
    )
    print(
        json.dumps(
            {
                "steps": args.steps,
                "pairs": args.pairs,
                **summary,
                "threads": int(os.environ.get("OMP_NUM_THREADS", 0)) or None,
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nanogpt", type=Path, required=True, help="a clone of karpathy/nanoGPT")
    parser.add_argument("--data", help="corpus for gptlab's data.path (default: the embedded corpus)")
    parser.add_argument("--out", type=Path, default=Path("outputs/side_by_side"))
    parser.add_argument("--short", type=int, default=30, help="speed: steps of the short runs")
    parser.add_argument("--long", type=int, default=130, help="speed: steps of the long runs")
    parser.add_argument("--rounds", type=int, default=2, help="speed: interleaved rounds")
    parser.add_argument(
        "--no-warmup", action="store_true", help="speed: no untimed run of each program first"
    )
    parser.add_argument("--loss", action="store_true", help="full runs: the final validation loss of each")
    parser.add_argument("--steps", type=int, default=320, help="--loss: steps of each run")
    parser.add_argument("--pairs", type=int, default=2, help="--loss: pairs of runs")
    parser.add_argument("--eval-iters", type=int, default=20, help="nanoGPT's validation batches")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "overrides", nargs="*", help="more gptlab overrides, e.g. data.stride=1 (windows at every offset)"
    )
    args = parser.parse_args()
    if not (args.nanogpt / "train.py").is_file() or not (args.nanogpt / "model.py").is_file():
        raise SystemExit(
            f"--nanogpt {args.nanogpt}: no nanoGPT train.py/model.py there; clone karpathy/nanoGPT"
        )
    args.nanogpt = args.nanogpt.resolve()
    data = args.out.resolve() / "data"
    n_train, n_val = export_tokens(args.data, data)
    print(f"tokens: {n_train:,} train, {n_val:,} val in {data} (nanoGPT's layout)", flush=True)
    device = "gpu" if args.device == "cuda" else "cpu"
    (loss if args.loss else speed)(args, data, device)


if __name__ == "__main__":
    main()
