"""What the SHA-256 digest beside each checkpoint costs: a model=small checkpoint (its weights and AdamW's
two moments, about 190 MB) is saved the way training saves it, then read the way resuming reads it, and the
seconds of the digest are printed beside the seconds of the save and the load, and what a save written in the
background (the default during training) makes the step wait. The files live in a temporary folder, deleted
afterwards.

With ``--sharded-gb``, a synthetic sharded checkpoint folder of that size (random bytes: eight equal shards, as
eight ranks write, and two small files) is hashed the way a save hashes it: by one process, then by two
processes (gloo, on this machine) sharing the files (``gptlab.runs.digests.compute_shared``); the files are
read from the page cache both times (just written).

    python scripts/checkpoint_digest_cost.py                    # 3 repeats, medians
    python scripts/checkpoint_digest_cost.py --sharded-gb 1     # one rank vs two ranks, 1 GB
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gptlab.model.config import GPTConfig
from gptlab.model.gpt import GPT
from gptlab.parallel.checkpoint_io import AtomicCheckpointIO, gather_objects
from gptlab.runs import digests
from gptlab.runs.checkpoints import load_checkpoint
from gptlab.runs.layout import LAST_CHECKPOINT


def small_checkpoint() -> dict:
    """model=small with the GPT-2 vocabulary, after one AdamW step (so its moments exist)."""
    model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=256, block_size=256, vocab_size=50257))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    return {"state_dict": state, "optimizer_states": [optimizer.state_dict()], "global_step": 1}


def seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def sharded_folder(root: Path, total_bytes: int) -> Path:
    """``root/last.ckpt``: eight shards of random bytes making ``total_bytes``, a .metadata and a meta.pt."""
    folder = root / "last.ckpt"
    folder.mkdir()
    for rank in range(8):
        with open(folder / f"__{rank}_0.distcp", "wb") as f:
            left = total_bytes // 8
            while left > 0:
                f.write(os.urandom(min(left, 64 << 20)))
                left -= 64 << 20
    (folder / ".metadata").write_bytes(os.urandom(40_000))
    (folder / "meta.pt").write_bytes(os.urandom(2_000))
    return folder


def _shared_rank(rank: int, folder: Path, port: int, repeats: int, out: Path) -> None:
    """One of two ranks: hash ``folder`` together ``repeats`` times, each timed from a barrier to the end of
    the slower rank (what a save waits for)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    times, cpu = [], []
    for _ in range(repeats):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        digests.compute_shared(folder, folder.name, rank, 2, gather_objects)
        cpu.append(time.process_time() - c0)  # this rank's own hashing and its part of the exchanges
        dist.barrier()
        times.append(time.perf_counter() - t0)
    out.with_suffix(f".{rank}").write_text(f"{statistics.median(times)} {statistics.median(cpu)}")
    dist.destroy_process_group()


def sharded(gb: float, repeats: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = sharded_folder(Path(tmp), int(gb * 1e9))
        size = sum(p.stat().st_size for p in folder.iterdir())
        digests.compute(folder)  # into the page cache, as a checkpoint just written is
        one, one_cpu = [], []
        for _ in range(repeats):
            c0 = time.process_time()
            one.append(seconds(lambda: digests.compute(folder)))
            one_cpu.append(time.process_time() - c0)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = Path(tmp) / "shared.txt"
        mp.spawn(_shared_rank, args=(folder, port, repeats, out), nprocs=2)
        (m2, cpu0), (_, cpu1) = (map(float, out.with_suffix(f".{r}").read_text().split()) for r in (0, 1))
    m1 = statistics.median(one)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"sharded checkpoint: {size / 1e9:.2f} GB in 10 files, medians of {repeats}; {os.cpu_count()} cores, "
        f"load average {load}"
    )
    print(
        f"hashed by one rank: {m1:.2f} s ({size / 1e6 / m1:.0f} MB/s); its CPU seconds: "
        f"{statistics.median(one_cpu):.2f}"
    )
    print(
        f"shared by two ranks: {m2:.2f} s ({size / 1e6 / m2:.0f} MB/s), {m1 / m2:.2f}x; each rank's CPU "
        f"seconds: {cpu0:.2f} and {cpu1:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--sharded-gb", type=float, default=None, help="time a synthetic sharded folder of this size instead"
    )
    args = parser.parse_args()
    if args.sharded_gb is not None:
        return sharded(args.sharded_gb, args.repeats)
    checkpoint = small_checkpoint()
    io = AtomicCheckpointIO()
    rows: dict[str, list[float]] = {"save": [], "digest": [], "load": [], "verify": [], "step_waits": []}

    def in_background() -> None:
        with io.in_background():
            io.save_checkpoint(checkpoint, path)

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / LAST_CHECKPOINT
        for _ in range(args.repeats):
            rows["save"].append(seconds(lambda: io.save_checkpoint(checkpoint, path)))  # digest included
            rows["digest"].append(seconds(lambda: digests.compute(path)))  # the part the digest adds
            rows["load"].append(seconds(lambda: load_checkpoint(path)))  # verify included
            rows["verify"].append(seconds(lambda: digests.check(path)))
            # a save during training (callbacks.last_checkpoint.background): what the step waits for, the copy
            # to host memory; the thread then writes it while the step would go on
            rows["step_waits"].append(seconds(in_background))
            io.wait()
        size = path.stat().st_size
        io.teardown()
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"model=small checkpoint: {size / 1e6:.0f} MB, medians of {args.repeats}")
    print(
        f"save {med['save']:.2f} s, of which the digest {med['digest']:.2f} s ({size / 1e6 / med['digest']:.0f} MB/s)"
    )
    print(f"load {med['load']:.2f} s, of which the check {med['verify']:.2f} s")
    print(
        f"saved in the background (the default during training): the step waits {med['step_waits']:.3f} s, the "
        f"copy to host memory (first save {rows['step_waits'][0]:.3f} s, its buffers then reused)"
    )


if __name__ == "__main__":
    main()
