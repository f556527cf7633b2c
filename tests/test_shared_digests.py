"""The hashing of a sharded checkpoint shared among ranks (gptlab.runs.digests): the split of the files, and
the digests and the verdict every rank gets. The ranks here are threads exchanging their values through a
barrier, as ``all_gather_object`` does between processes; the real two-process run over gloo is
test_strategies.py's FSDP test."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gptlab.runs import digests

SIZES = [5000, 300, 70_000, 1, 0, 4096, 4096, 65_000, 12, 900_000, 128, 33_333]


def test_the_files_are_dealt_once_each_balanced_by_bytes_and_the_same_on_every_rank():
    files = [(f"last.ckpt/__{i}_0.distcp", size) for i, size in enumerate(SIZES)]
    for ranks in (1, 2, 3, 8):
        dealt = digests.shares(files, ranks)
        assert len(dealt) == ranks
        names = [name for share in dealt for name in share]
        assert sorted(names) == sorted(name for name, _ in files)  # every file, exactly once
        shuffled = files[:]
        random.Random(ranks).shuffle(shuffled)
        assert digests.shares(shuffled, ranks) == dealt  # every rank lists in its own order: same shares
        size_of = dict(files)
        loads = [sum(size_of[n] for n in share) for share in dealt]
        # Greedy by size: no rank has more than the least loaded one plus one file.
        assert max(loads) - min(loads) <= max(SIZES)
    # Two ranks: the largest file alone on one, everything else on the other.
    small, large = sorted(digests.shares(files, 2), key=len, reverse=True)
    assert large == ["last.ckpt/__9_0.distcp"] and len(small) == len(SIZES) - 1
    # Many equal files split evenly.
    even = digests.shares([(f"f{i}", 100) for i in range(10)], 2)
    assert [len(s) for s in even] == [5, 5]


class ThreadRanks:
    """``ranks`` threads that run ``work(rank, gather)`` together; ``gather`` exchanges one value each."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self.barrier = threading.Barrier(ranks, timeout=60)
        self.slots: list[Any] = [None] * ranks

    def gather_for(self, rank: int) -> Callable[[Any], list[Any]]:
        def gather(value: Any) -> list[Any]:
            self.slots[rank] = value
            self.barrier.wait()
            values = list(self.slots)
            self.barrier.wait()  # every rank has read before the next exchange overwrites
            return values

        return gather

    def run(self, work: Callable[[int, Callable[[Any], list[Any]]], Any]) -> list[Any]:
        results: list[Any] = [None] * self.ranks

        def one(rank: int) -> None:
            try:
                results[rank] = work(rank, self.gather_for(rank))
            except Exception as e:  # compared with the other ranks' below
                results[rank] = e

        threads = [threading.Thread(target=one, args=(r,)) for r in range(self.ranks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a rank is still waiting"
        return results


def sharded_folder(root: Path) -> Path:
    folder = root / "last.ckpt"
    (folder / "sub").mkdir(parents=True)
    rng = random.Random(0)
    for i, size in enumerate(SIZES):
        (folder / ("sub" if i % 4 == 0 else ".") / f"__{i}_0.distcp").write_bytes(rng.randbytes(size))
    return folder


def test_shared_hashing_gives_every_rank_the_single_process_digests_each_file_hashed_once(tmp_path):
    folder = sharded_folder(tmp_path)
    hashed: list[tuple[int, str]] = []

    def save(rank: int, gather):
        return digests.compute_shared(
            folder, "last.ckpt", rank, 2, gather, lambda p: hashed.append((rank, p.name))
        )

    results = ThreadRanks(2).run(save)
    alone = digests.compute(folder)
    assert results[0] == results[1] == alone  # same digests, same order: the same digest file
    assert sorted(name for _, name in hashed) == sorted(p.name for p in folder.rglob("*.distcp"))
    share_1 = digests.shares([(f.name, f.size) for f in alone], 2)[1]
    assert sorted(name for rank, name in hashed if rank == 1) == sorted(n.rsplit("/", 1)[1] for n in share_1)


def test_a_shard_changed_in_one_ranks_share_gives_every_rank_the_single_process_verdict(tmp_path):
    folder = sharded_folder(tmp_path)
    digests.write_digest(folder, digests.compute(folder), step=6)
    manifest = digests.read_digest(folder)
    for rank in (0, 1):
        share = digests.shares([(f.name, f.size) for f in manifest.files], 2)[rank]
        name = next(n for n in share if next(f.size for f in manifest.files if f.name == n) > 0)
        path = folder / name.split("/", 1)[1]
        original = path.read_bytes()
        path.write_bytes(bytes([original[0] ^ 0xFF]) + original[1:])
        results = ThreadRanks(2).run(lambda r, gather: digests.check_shared(folder, r, 2, gather))
        alone = digests.check(folder)
        assert len(alone.problems) == 1 and name in alone.problems[0]
        assert results[0].problems == results[1].problems == alone.problems
        assert results[0].step == results[1].step == 6
        path.write_bytes(original)
    # Truncated and missing files, in both shares: the same list, in the digest file's order.
    files = sorted(p for p in folder.rglob("*.distcp") if p.stat().st_size > 10)
    files[0].unlink()
    with open(files[-1], "r+b") as f:
        f.truncate(3)
    results = ThreadRanks(2).run(lambda r, gather: digests.check_shared(folder, r, 2, gather))
    assert results[0].problems == results[1].problems == digests.check(folder).problems
    assert len(results[0].problems) == 2


def test_a_file_one_rank_cannot_read_stops_every_rank_with_the_same_error(tmp_path):
    folder = sharded_folder(tmp_path)

    def vanish_on_rank_1(rank: int, path: Path) -> None:
        if rank == 1:
            path.unlink()  # gone between the listing and the hashing (another process removed it)

    results = ThreadRanks(2).run(
        lambda r, gather: digests.compute_shared(
            folder, "last.ckpt", r, 2, gather, lambda p: vanish_on_rank_1(r, p)
        )
    )
    assert all(isinstance(r, OSError) for r in results), results
    assert str(results[0]) == str(results[1])
    assert str(results[0]).startswith("hashing the checkpoint's files failed on rank 1: FileNotFoundError")


@pytest.mark.parametrize("ranks", [1, 3])
def test_any_number_of_ranks_agrees_with_one_process(tmp_path, ranks):
    folder = sharded_folder(tmp_path)
    results = ThreadRanks(ranks).run(
        lambda r, gather: digests.compute_shared(folder, "last.ckpt", r, ranks, gather)
    )
    assert all(result == digests.compute(folder) for result in results)
