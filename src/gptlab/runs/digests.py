"""A SHA-256 digest beside every checkpoint, written when it is saved and checked before it is read.

``checkpoints/<name>.ckpt`` gets ``checkpoints/<name>.ckpt.sha256``, in ``sha256sum``'s own format (so
``sha256sum -c <name>.ckpt.sha256``, run in that folder, checks it by hand), with each file's size and the
checkpoint's step as comment lines, which ``sha256sum`` skips (here for the last checkpoint of a run,
:func:`gptlab.runs.layout.last_checkpoint`)::

    # gptlab checkpoint digest, step 12. Check by hand in the checkpoint's folder: sha256sum -c <name>.ckpt.sha256
    # bytes 192937279 <name>.ckpt
    9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08  <name>.ckpt

A sharded checkpoint (a directory: a distributed checkpoint's shards, or DeepSpeed's files) gets one line
per file in it (``<name>.ckpt/__0_0.distcp``, ...): the digest file is the directory's manifest.

The order of a save keeps a digest from ever refusing a good checkpoint: the old digest is removed before the
new checkpoint is renamed into place, and the new digest is written (to a temporary file, renamed) after it.
A kill between the two leaves a checkpoint without a digest, which loads with a warning that it was not
verified, as do the checkpoints of gptlab versions that wrote none.

Python's SHA-256 ran at about 1 GB/s on an idle core of this project's CPU machine (it has SHA instructions),
and at 300-380 MB/s with the machine loaded four times over: 0.2 to 0.65 s for model=small's 193 MB checkpoint,
added to each save and to each load (``scripts/checkpoint_digest_cost.py`` measures it).

The files of a sharded checkpoint are hashed by all the ranks of the run, each its share, rather than by
one process while every other waits (a 7B model's sharded checkpoint with its optimizer states is about
100 GB: 100 s at 1 GB/s). :func:`shares` deals the files by size, largest first, each to the rank with the
fewest bytes so far, the same on every rank. At a save (:func:`compute_shared`) each rank fsyncs and hashes
its share of rank 0's listing of the directory, the digests are gathered, and rank 0 writes the one digest
file, in the same order and format as one process writes it. At a load (:func:`check_shared`, once the
process group exists: a resume's planning, before it, compares the files' sizes only) each rank checks its
share of what rank 0's digest file lists and the differences are gathered, so every rank reaches the same
verdict and refuses with the same message; a rank that cannot read its share stops every rank with the same
error. The exchanges are ``all_gather_object`` over the run's process group, whose timeout
(``strategy.timeout_s``) bounds the wait for a lost rank, as it does for the save's barriers; one process
hashes every file itself, as before. ``python scripts/checkpoint_digest_cost.py --sharded-gb 1`` times a 1 GB
folder of ten files: one rank 0.8-1.5 s, two ranks sharing it 1.0-1.6 s on this project's two-core machine
under a load average of 4 to 6 (other users' work): each rank hashed half the bytes (0.52 CPU seconds each,
against 0.76-0.79 for one rank hashing all), but the two cores were not free for it, so the wall time did not
halve here (1.48x at best, 0.70x at worst, over five runs). With a free core per rank it should fall towards
1/N (not measured: no such machine here); each rank reads 1/N of the bytes at a load either way.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gptlab.runs.layout import DIGEST_SUFFIX, NESTED_DIGEST_DIR

log = logging.getLogger(__name__)

_CHUNK = 8 << 20  # bytes read at a time: large reads, bounded memory
_SIZE_PREFIX = "# bytes "


@dataclass(frozen=True)
class FileDigest:
    """One file of a checkpoint: its name as the digest file lists it (``<name>.ckpt``, or
    ``<name>.ckpt/__0_0.distcp`` inside a directory), its size and its SHA-256."""

    name: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """What a digest file says a checkpoint was when it was written."""

    files: list[FileDigest]
    step: int | None


def digest_path(checkpoint: Path) -> Path:
    """``<name>.ckpt`` -> ``<name>.ckpt.sha256``, beside it; ``hpc_ckpt_1.ckpt`` ->
    ``digests/hpc_ckpt_1.ckpt.sha256`` (:data:`NESTED_DIGEST_DIR`)."""
    checkpoint = Path(checkpoint)
    if "ckpt_" in checkpoint.name:
        return checkpoint.parent / NESTED_DIGEST_DIR / (checkpoint.name + DIGEST_SUFFIX)
    return checkpoint.with_name(checkpoint.name + DIGEST_SUFFIX)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(checkpoint: Path, name: str) -> list[tuple[str, Path]]:
    """(the name the digest file lists, the file) for each file of ``checkpoint``, in a fixed order."""
    if checkpoint.is_dir():
        return [
            (f"{name}/{p.relative_to(checkpoint).as_posix()}", p)
            for p in sorted(checkpoint.rglob("*"))
            if p.is_file()
        ]
    return [(name, checkpoint)]


def compute(checkpoint: Path, name: str | None = None) -> list[FileDigest]:
    """The digests of ``checkpoint``'s files (a file, or every file in a directory). ``name``: the name the
    checkpoint will have once renamed into place (it is hashed under its temporary name)."""
    checkpoint = Path(checkpoint)
    return [
        FileDigest(listed, path.stat().st_size, sha256_of(path))
        for listed, path in _files(checkpoint, name or checkpoint.name)
    ]


def write_digest(checkpoint: Path, files: list[FileDigest], step: int | None = None) -> Path:
    """Write ``<checkpoint>.sha256`` whole or not at all (a temporary file, fsynced, renamed over it)."""
    target = digest_path(checkpoint)
    target.parent.mkdir(exist_ok=True)
    header = "# gptlab checkpoint digest" + (f", step {step}" if step is not None else "")
    where = target.relative_to(Path(checkpoint).parent).as_posix()
    lines = [f"{header}. Check by hand in the checkpoint's folder: sha256sum -c {where}"]
    for f in files:
        lines += [f"{_SIZE_PREFIX}{f.size} {f.name}", f"{f.sha256}  {f.name}"]
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as out:
            out.write("\n".join(lines) + "\n")
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def remove_digest(checkpoint: Path) -> None:
    """Remove ``<checkpoint>.sha256`` (before the checkpoint is replaced or removed: a digest never outlives
    the bytes it describes) and any temporary file a killed write of it left."""
    target = digest_path(checkpoint)
    target.unlink(missing_ok=True)
    for stale in target.parent.glob(f".{target.name}.tmp-*"):
        stale.unlink(missing_ok=True)


def read_digest(checkpoint: Path) -> Manifest | None:
    """The digest file of ``checkpoint``; None when it has none. A digest file that cannot be parsed lists no
    files, which :func:`differences` reports."""
    path = digest_path(checkpoint)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError):
        return Manifest([], None)
    sizes: dict[str, int] = {}
    files: list[FileDigest] = []
    step: int | None = None
    for line in text.splitlines():
        if line.startswith(_SIZE_PREFIX):
            size, _, name = line[len(_SIZE_PREFIX) :].partition(" ")
            if size.isdigit():
                sizes[name] = int(size)
        elif line.startswith("# gptlab checkpoint digest, step "):
            number = line.split("step ", 1)[1].split(".", 1)[0]
            step = int(number) if number.isdigit() else None
        elif not line.startswith("#") and "  " in line:
            sha, name = line.split("  ", 1)
            if len(sha) == 64 and name in sizes:
                files.append(FileDigest(name, sizes[name], sha.lower()))
    return Manifest(files, step)


def _short(sha: str) -> str:
    return f"{sha[:12]}..."


def differences(checkpoint: Path, manifest: Manifest, hash_files: bool = True) -> list[str]:
    """How ``checkpoint`` now differs from what its digest file says was written; empty when it is intact.
    Sizes are compared first: a truncated file is named as such without being read. ``hash_files=False``
    compares the sizes alone."""
    checkpoint = Path(checkpoint)
    if not manifest.files:
        return [f"its digest file {digest_path(checkpoint).name} is unreadable or lists no files"]
    found: list[str] = []
    for expected in manifest.files:
        relative = expected.name.split("/", 1)[1] if "/" in expected.name else None
        path = checkpoint / relative if relative is not None else checkpoint
        if not path.is_file():
            found.append(f"{expected.name} is missing")
            continue
        size = path.stat().st_size
        if size != expected.size:
            how = "truncated" if size < expected.size else "grown"
            found.append(
                f"{expected.name} is {size:,} bytes instead of the {expected.size:,} written ({how})"
            )
            continue
        if not hash_files:
            continue
        actual = sha256_of(path)
        if actual != expected.sha256:
            found.append(
                f"{expected.name} has the size written ({size:,} bytes) but SHA-256 {_short(actual)} instead "
                f"of {_short(expected.sha256)}"
            )
    return found


@dataclass(frozen=True)
class Verdict:
    """A checkpoint checked against its digest: ``verified`` (it matches), ``problems`` (how it differs),
    or neither (it has no digest)."""

    checkpoint: Path
    manifest: Manifest | None
    problems: list[str]

    @property
    def has_digest(self) -> bool:
        return self.manifest is not None

    @property
    def verified(self) -> bool:
        return self.manifest is not None and not self.problems

    @property
    def step(self) -> int | None:
        return self.manifest.step if self.manifest else None


def check(checkpoint: Path, hash_files: bool = True) -> Verdict:
    """Compare ``checkpoint`` (a file or a sharded directory) with its digest file. ``hash_files=False``
    compares the files' sizes alone (what a rank checks before the ranks share the hashing: :func:`check_shared`)."""
    manifest = read_digest(checkpoint)
    found = differences(checkpoint, manifest, hash_files=hash_files) if manifest else []
    return Verdict(Path(checkpoint), manifest, found)


# ---- the hashing of a sharded checkpoint shared among the ranks of a distributed run ----------------------

#: Every rank's value, in rank order, on every rank: a collective (``torch.distributed.all_gather_object``
#: over the run's process group, whose timeout bounds the wait for a rank that is lost).
Gather = Callable[[Any], list[Any]]


def shares(files: Sequence[tuple[str, int]], ranks: int) -> list[list[str]]:
    """Deal the files (name, bytes) to ``ranks`` ranks, balanced by bytes: the largest first (equal sizes by
    name), each to the rank with the fewest bytes so far (the lowest rank on a tie). Each file goes to exactly
    one rank, and every rank computes the same shares from the same list, in any order. Each share is in name
    order."""
    dealt: list[list[str]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for name, size in sorted(files, key=lambda f: (-f[1], f[0])):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        dealt[rank].append(name)
        load[rank] += size
    return [sorted(share) for share in dealt]


def _rank_results(gathered: list[Any]) -> list[Any]:
    """The values the ranks gathered, or an OSError, raised on every rank alike, naming the ranks that
    failed (a file one rank cannot read stops every rank, not one while the others wait)."""
    failed = [f"rank {rank}: {value[1]}" for rank, value in enumerate(gathered) if value[0] == "error"]
    if failed:
        raise OSError(f"hashing the checkpoint's files failed on {'; '.join(failed)}")
    return [value[1] for value in gathered]


def _guarded(work: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return ("ok", work())
    except Exception as e:  # sent to every rank, which then all raise it (see _rank_results)
        return ("error", f"{type(e).__name__}: {e}")


def compute_shared(
    checkpoint: Path,
    name: str,
    rank: int,
    ranks: int,
    gather: Gather,
    before_hashing: Callable[[Path], None] | None = None,
) -> list[FileDigest]:
    """:func:`compute` for a sharded checkpoint directory, called by every rank of a distributed run: rank 0's
    listing of the directory is dealt among the ranks (:func:`shares`), each hashes its share
    (``before_hashing`` is run on each of its files first, e.g. an fsync), and every rank gets every file's
    digest, in the order :func:`compute` gives them. Two collectives (``gather``)."""
    checkpoint = Path(checkpoint)
    listing = (  # rank 0's alone: every rank deals the same list
        _guarded(lambda: [(listed, p.stat().st_size) for listed, p in _files(checkpoint, name)])
        if rank == 0
        else ("ok", None)
    )
    files: list[tuple[str, int]] = _rank_results(gather(listing))[0]
    mine = set(shares(files, ranks)[rank])
    paths = dict(_files_by_name(checkpoint, name, [listed for listed, _ in files]))

    def hash_mine() -> list[FileDigest]:
        found = []
        for listed, _ in files:
            if listed in mine:
                path = paths[listed]
                if before_hashing is not None:
                    before_hashing(path)
                found.append(FileDigest(listed, path.stat().st_size, sha256_of(path)))
        return found

    by_name = {f.name: f for share in _rank_results(gather(_guarded(hash_mine))) for f in share}
    return [by_name[listed] for listed, _ in files]


def _files_by_name(checkpoint: Path, name: str, listed: list[str]) -> list[tuple[str, Path]]:
    """The path of each name a digest lists (``<name>/<relative path>``) inside ``checkpoint``."""
    return [
        (item, checkpoint / item.split("/", 1)[1]) if "/" in item else (item, checkpoint) for item in listed
    ]


def check_shared(checkpoint: Path, rank: int, ranks: int, gather: Gather) -> Verdict:
    """:func:`check` for a sharded checkpoint directory, called by every rank of a distributed run: each
    rank checks its share of the files rank 0's digest file lists (:func:`shares`, by the sizes written),
    and every rank gets the same verdict, with the differences in the order :func:`check` gives them (the
    same message on every rank). Two collectives (``gather``)."""
    checkpoint = Path(checkpoint)
    read = _guarded(lambda: read_digest(checkpoint)) if rank == 0 else ("ok", None)
    manifest: Manifest | None = _rank_results(gather(read))[0]
    if manifest is None or not manifest.files:
        return Verdict(checkpoint, manifest, differences(checkpoint, manifest) if manifest else [])
    mine = set(shares([(f.name, f.size) for f in manifest.files], ranks)[rank])

    def check_mine() -> dict[str, list[str]]:
        return {
            f.name: differences(checkpoint, Manifest([f], manifest.step))
            for f in manifest.files
            if f.name in mine
        }

    found: dict[str, list[str]] = {}
    for share in _rank_results(gather(_guarded(check_mine))):
        found.update(share)
    return Verdict(checkpoint, manifest, [p for f in manifest.files for p in found.get(f.name, [])])
