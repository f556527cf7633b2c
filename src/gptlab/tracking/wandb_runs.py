"""Read W&B runs back: from a run's local ``run-*.wandb`` file (offline runs, or the local copy of online ones),
or through the W&B public API (online runs of a group; needs the network and a login).

W&B keeps no readable copy of an offline run's metrics and its API cannot see offline runs, so this reads
the transaction log itself. The file is a LevelDB-style log: a 7-byte header (``:W&B``, magic 0xBEE1,
version), then 32 KiB blocks of records, each with a 7-byte header (crc32, length, type FULL/FIRST/MIDDLE/
LAST); a record's payload is a ``wandb_internal_pb2.Record`` protobuf.

A file damaged on disk (bytes overwritten, a crash that left garbage) is read past the damage: where a
record's checksum does not match, reading goes on at the next place a whole record with a matching checksum
starts, and the fragments of a record cut by the damage are dropped whole. What was skipped is kept in
``WandbRun.damage`` (byte ranges), for a reader to say that values are missing rather than show fewer as if
they were all. A record cut short at the end of the file is one still being written (a run killed while W&B
wrote), not damage.
"""

from __future__ import annotations

import glob
import json
import os
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gptlab.errors import WandbFileError

BLOCK_SIZE = 32 * 1024
HEADER_SIZE = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
FILE_IDENT = b":W&B"
FILE_MAGIC = 0xBEE1


def iter_payloads(path: str | os.PathLike, damage: list[str] | None = None) -> Iterator[bytes]:
    """Yield each record's payload bytes, joining records split across blocks. A record whose checksum does
    not match raises :class:`WandbFileError`; with a ``damage`` list, reading goes on at the next whole record
    instead, and the skipped bytes are noted there."""
    data = Path(path).read_bytes()
    if len(data) < HEADER_SIZE or data[:4] != FILE_IDENT:
        raise WandbFileError(f"{path} is not a W&B run file (no ':W&B' header)")
    ident, magic, version = struct.unpack("<4sHB", data[:HEADER_SIZE])
    if magic != FILE_MAGIC:
        raise WandbFileError(f"{path}: unexpected magic {magic:#x} (version {version})")
    pos = HEADER_SIZE
    pending: list[bytes] | None = []  # None: skipping the fragments of a record cut by damage
    while pos + HEADER_SIZE <= len(data):
        left_in_block = BLOCK_SIZE - pos % BLOCK_SIZE
        if left_in_block < HEADER_SIZE:  # the block's tail is padding
            pos += left_in_block
            continue
        checksum, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER_SIZE])
        if length == 0 and kind == 0:  # zero padding, or the end of what was flushed
            pos += left_in_block
            continue
        if pos + HEADER_SIZE + length > len(data) and (
            damage is None or _next_record(data, pos + 1) == len(data)
        ):
            break  # a record still being written (no whole record after it: not a length damaged on disk)
        payload = data[pos + HEADER_SIZE : pos + HEADER_SIZE + length]
        if not _is_record(data, pos):
            if damage is None:
                raise WandbFileError(f"{path}: checksum mismatch at byte {pos}")
            end = _next_record(data, pos + 1)
            damage.append(f"bytes {pos:,}-{end:,} (no record whose checksum matches)")
            pos, pending = end, None  # a record cut here loses its fragments after the damage too
            continue
        pos += HEADER_SIZE + length
        if kind == FULL:
            pending = []
            yield payload
        elif kind == FIRST:
            pending = [payload]
        elif pending is None:  # the middle or the end of a record whose start was skipped
            continue
        elif kind == MIDDLE:
            pending.append(payload)
        elif kind == LAST:
            pending.append(payload)
            yield b"".join(pending)
            pending = []


def _is_record(data: bytes, pos: int) -> bool:
    """Whether a whole record starts at ``pos``: a known type, inside its block, its checksum matching."""
    left_in_block = BLOCK_SIZE - pos % BLOCK_SIZE
    if left_in_block < HEADER_SIZE or pos + HEADER_SIZE > len(data):
        return False
    checksum, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER_SIZE])
    if kind not in (FULL, FIRST, MIDDLE, LAST) or HEADER_SIZE + length > left_in_block:
        return False
    payload = data[pos + HEADER_SIZE : pos + HEADER_SIZE + length]
    return len(payload) == length and zlib.crc32(bytes([kind]) + payload) & 0xFFFFFFFF == checksum


def _next_record(data: bytes, start: int) -> int:
    """Where the first whole record at or after ``start`` begins (the end of ``data`` if none does): reading
    resumes there after damage. A false match needs a 32-bit checksum to agree by chance."""
    for pos in range(start, len(data) - HEADER_SIZE + 1):
        if data[pos + 4] or data[pos + 5]:  # a record of some length (zero padding is not one)
            if _is_record(data, pos):
                return pos
    return len(data)


def _value(item: Any) -> Any:
    return json.loads(item.value_json) if item.value_json else None


def _key(item: Any) -> str:
    return "/".join(item.nested_key) if item.nested_key else item.key


@dataclass
class WandbRun:
    path: Path
    run_id: str = ""
    name: str = ""
    project: str = ""
    group: str = ""
    job_type: str = ""
    tags: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    exit_code: int | None = None
    damage: list[str] = field(default_factory=list)  # what could not be read (byte ranges); empty when whole

    def metric(self, key: str) -> list[tuple[int, float]]:
        """(step, value) pairs of one metric, in logged order; the step is Lightning's global step."""
        out: list[tuple[int, float]] = []
        for row in self.history:
            if key in row:
                step: Any = row.get("trainer/global_step", row.get("_step", len(out)))
                out.append((int(step), row[key]))
        return out


def read_run(path: str | os.PathLike) -> WandbRun:
    """Parse a ``run-*.wandb`` file (or a run folder holding one) into run info, config, history and summary."""
    from wandb.proto import wandb_internal_pb2 as pb

    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.wandb"))
        if not files:
            raise WandbFileError(f"{path} holds no .wandb file")
        path = files[0]
    from google.protobuf.message import DecodeError  # type: ignore[import-untyped]

    run = WandbRun(path=path)
    for payload in iter_payloads(path, run.damage):
        record = pb.Record()  # type: ignore[attr-defined]  # generated protobuf module without stubs
        try:
            record.ParseFromString(payload)
        except DecodeError:  # its checksum matched, its bytes are not a record: counted as damage too
            run.damage.append(f"a record of {len(payload):,} bytes that is not a W&B record")
            continue
        kind = record.WhichOneof("record_type")
        if kind == "run":
            r = record.run
            run.run_id, run.name, run.project = r.run_id, r.display_name, r.project
            run.group, run.job_type, run.tags = r.run_group, r.job_type, list(r.tags)
            for item in r.config.update:
                run.config[_key(item)] = _value(item)
        elif kind == "config":
            for item in record.config.update:
                run.config[_key(item)] = _value(item)
            for item in record.config.remove:
                run.config.pop(_key(item), None)
        elif kind == "history":
            run.history.append({_key(item): _value(item) for item in record.history.item})
        elif kind == "summary":
            for item in record.summary.update:
                run.summary[_key(item)] = _value(item)
        elif kind == "exit":
            run.exit_code = record.exit.exit_code
    # W&B wraps each config entry as {"value": ..., "desc": ...}.
    run.config = {
        k: (v["value"] if isinstance(v, dict) and "value" in v else v) for k, v in run.config.items()
    }
    return run


def find_runs(root: str | os.PathLike) -> list[Path]:
    """Every ``run-*.wandb`` file below ``root`` (offline and online run folders)."""
    found = glob.glob(os.path.join(str(root), "**", "run-*.wandb"), recursive=True)
    # wandb/latest-run is a link to the newest run folder: count each run once.
    return sorted(Path(p) for p in found if "latest-run" not in Path(p).parts)


def group_runs(project: str, group: str) -> Any:
    """The runs of one W&B group (``project`` as ``entity/project``): ``wandb.apis.public.Run`` objects,
    fetched lazily as they are iterated."""
    import wandb

    return wandb.Api().runs(project, filters={"group": group})
