"""Benchmark corpus preparation: generate jsonl corpora of the given sizes (real English paragraphs from
the standard library's pydoc reference text, shuffled into documents of 0.5-8 KB), prepare each with GPT-2's
tokenizer in a child process, and print the child's time, text throughput and peak memory. Everything lives
in a temporary folder (the corpus, ``datasets``' Arrow cache, the token cache) and is deleted afterwards.

    python scripts/benchmark_data.py                  # 0.2 and 1.2 GB
    python scripts/benchmark_data.py --sizes 0.05 --num-proc 2

Peak memory is given two ways: ``ru_maxrss`` of the child (the largest single process of the preparation,
pool workers included, as the kernel accounts it), and the largest sum of the resident memory of the child
and its pool workers (PSS, so the pages the forked workers share are counted once), sampled every 0.1 s
from /proc. MB/s: text bytes over the time ``prepare`` took in the child (reading the jsonl into Arrow,
the length pass, tokenizing, writing); "wall" adds the interpreter's start and imports. MB/CPU-s: text bytes
over the CPU seconds the child and its workers spent in ``prepare``, which a busy machine does not
change: times the cores, it is what an idle machine would reach.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, logging, resource, sys, time
logging.basicConfig(level=logging.INFO, format="%(message)s")
from gptlab.data import corpus
spec = corpus.DataSpec(path=sys.argv[1], cache_dir=sys.argv[2], num_proc=int(sys.argv[3]) or None)
def cpu():
    return sum(u.ru_utime + u.ru_stime for u in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))
t0, cpu0 = time.perf_counter(), cpu()
prepared = corpus.prepare(spec, "gpt2")
print(json.dumps({"seconds": time.perf_counter() - t0, "splits": prepared.meta["splits"],
                  "shards": len(prepared.train.shards),
                  "maxrss_kib": max(resource.getrusage(r).ru_maxrss
                                    for r in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)),
                  "cpu_s": cpu() - cpu0}))
"""


def generate(path: Path, n_bytes: int, seed: int = 0) -> int:
    from pydoc_data import topics

    paragraphs = [p.strip() for t in topics.topics.values() for p in t.split("\n\n") if len(p.strip()) > 40]
    rng = random.Random(seed)
    written = 0
    with open(path, "w") as f:
        while written < n_bytes:
            target = rng.randint(500, 8000)
            doc, size = [], 0
            while size < target:
                p = rng.choice(paragraphs)
                doc.append(p)
                size += len(p) + 2
            line = json.dumps({"text": "\n\n".join(doc)}) + "\n"
            f.write(line)
            written += len(line)
    return os.path.getsize(path)


def tree_pss(pid: int) -> int:
    """Proportional resident bytes (PSS: pages shared by the forked workers counted once) of ``pid`` and
    its descendants."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def run_case(size_gb: float, num_proc: int, workdir: Path) -> dict:
    corpus_file = workdir / f"corpus-{size_gb}.jsonl"
    t0 = time.perf_counter()
    n_bytes = generate(corpus_file, int(size_gb * 1e9))
    print(f"generated {n_bytes / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s", flush=True)
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "src"),
        "HF_HOME": str(workdir / "hf"),  # datasets' Arrow copy of the corpus goes here too
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(corpus_file), str(workdir / "cache"), str(num_proc)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    peak_tree = 0
    while proc.poll() is None:
        peak_tree = max(peak_tree, tree_pss(proc.pid))
        time.sleep(0.1)
    wall = time.perf_counter() - start
    out = proc.stdout.read()
    if proc.returncode:
        raise SystemExit(f"preparation failed ({proc.returncode})")
    result = json.loads(out.strip().splitlines()[-1])
    shutil.rmtree(workdir / "cache", ignore_errors=True)
    shutil.rmtree(workdir / "hf", ignore_errors=True)
    corpus_file.unlink()
    tokens = result["splits"]["train"]["tokens"] + result["splits"]["val"]["tokens"]
    return {
        "size_gb": n_bytes / 1e9,
        "wall_s": wall,
        "prepare_s": result["seconds"],
        "mb_per_s": n_bytes / 1e6 / result["seconds"],
        "mb_per_cpu_s": n_bytes / 1e6 / result["cpu_s"],
        "tokens": tokens,
        "shards": result["shards"],
        "maxrss_gib": result["maxrss_kib"] * 1024 / 2**30,  # KiB on Linux
        "tree_peak_gib": peak_tree / 2**30,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=float, nargs="+", default=[0.2, 1.2], help="corpus sizes in GB")
    parser.add_argument("--num-proc", type=int, default=0, help="tokenizing processes; 0: the default")
    parser.add_argument("--dir", default=None, help="folder for the temporary files (default: /tmp)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="gptlab-bench-", dir=args.dir))
    try:
        rows = [run_case(size, args.num_proc, workdir) for size in args.sizes]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(
        f"\n{'text GB':>8} {'tokens':>12} {'shards':>6} {'wall s':>7} {'prepare s':>9} {'MB/s':>6} "
        f"{'MB/CPU-s':>8} {'maxrss GiB':>10} {'tree PSS GiB':>12}"
    )
    for r in rows:
        print(
            f"{r['size_gb']:8.2f} {r['tokens']:12,d} {r['shards']:6d} {r['wall_s']:7.1f} {r['prepare_s']:9.1f} "
            f"{r['mb_per_s']:6.2f} {r['mb_per_cpu_s']:8.2f} {r['maxrss_gib']:10.2f} {r['tree_peak_gib']:12.2f}"
        )
    if len(rows) > 1:
        print(
            f"peak (tree) of the largest / the smallest corpus: {rows[-1]['tree_peak_gib'] / rows[0]['tree_peak_gib']:.2f}"
        )


if __name__ == "__main__":
    main()
