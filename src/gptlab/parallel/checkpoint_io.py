"""Checkpoints written so that a kill at any moment leaves the previous one whole.

A single file is written beside its target and renamed over it (``os.replace``, atomic on POSIX). A
directory (a sharded FSDP or DeepSpeed checkpoint) is written whole beside its target, then swapped in by
two renames: the old directory aside, the new one into place. A kill between those two renames leaves the
old directory under its aside name; `restore_interrupted_saves` puts it back before a run resumes.
Rank 0's single file goes through `AtomicCheckpointIO`, the checkpoint I/O plugin of every strategy that
writes one file; the sharded strategies are Lightning's with their directory save made atomic
(`FullyShardedStrategy`, `AtomicDeepSpeedStrategy`, at the end of this module; the DeepSpeed one also
reports the gradient norm that ZeRO keeps out of ``p.grad``).

Each checkpoint gets its SHA-256 digest beside it (``<name>.ckpt.sha256``, :mod:`gptlab.runs.digests`), written
by the process that renames the checkpoint into place (rank 0): the old digest is removed before the rename,
the new one written after it, so a digest never describes other bytes than those beside it. The files of a
sharded checkpoint are hashed by all the ranks, each its share, when it is saved and when it is loaded.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.strategies import DeepSpeedStrategy, ModelParallelStrategy

from gptlab.parallel.ranks import WatchedRanks
from gptlab.parallel.sharded_vocab import load_fitting_vocab_rows
from gptlab.runs import digests
from gptlab.runs.layout import ASIDE, DCP, STAGING, checkpoint_kind, remove_path

log = logging.getLogger(__name__)


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable (POSIX: the directory entry lives in the directory's inode)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory file descriptors
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class HostSnapshot:
    """A point-in-time copy of a checkpoint in host memory, for a background write while training goes on.

    Each tensor's storage is copied once, so that tensors sharing one (a tied embedding and head) still share
    it in the file, as ``torch.save`` writes them. The copies go into buffers kept from one save to the next:
    parameters and optimizer states keep their storages from step to step, so after the first save a copy
    allocates nothing (on glibc, no page faults for large blocks; on a GPU host, no allocation per save).
    Containers (dicts, lists, tuples) are rebuilt; other values are shared, as the objects Lightning puts in a
    checkpoint are made for it. A tensor that is not a plain strided one (a DTensor, a sparse tensor) is copied
    to the host as it is.

    The buffers of CUDA tensors are pinned (page-locked) host memory where CUDA is available: the GPU's DMA
    engine copies into them directly, without the staging through a pinned bounce buffer that pageable memory
    takes, and the copies are queued without waiting (``non_blocking``), the whole snapshot then waited for
    once. ``pin``: None pins the buffers of CUDA tensors (the default), False none (pageable buffers, as on a
    CPU), True every buffer. Where pinning fails (no CUDA, or the driver refuses more page-locked memory), the
    buffers are pageable from then on, said once. torch's pinned allocator rounds each block up to a power of
    two and keeps the blocks it frees for reuse: the memory guard counts the rounded sizes, and where they do not
    fit but pageable buffers would, that save's new buffers are pageable (also said once)."""

    def __init__(self, pin: bool | None = None) -> None:
        self._buffers: dict[tuple[str, int, int], torch.UntypedStorage] = {}
        self._pin = pin
        self._pin_failed = False
        self._pin_this_copy = True  # False for a copy whose pinned buffers would not fit the guard
        self._said_too_large = False

    def _wants_pinned(self, device: torch.device) -> bool:
        if self._pin_failed or self._pin is False:
            return False
        return self._pin is True or (device.type == "cuda" and torch.cuda.is_available())

    def _new_bytes(self, checkpoint: dict[str, Any]) -> tuple[int, int]:
        """The bytes of the new buffers a copy of ``checkpoint`` needs (its storages that have none yet, each
        once, and the tensors copied as they are): as pageable buffers, and as the buffers it would take, pinned
        ones rounded up to a power of two as torch's pinned allocator rounds them."""
        storages: dict[tuple[str, int, int], torch.device] = {}
        pageable = 0
        for item in tensors_in(checkpoint):
            if type(item) is not torch.Tensor or item.layout != torch.strided:
                pageable += item.untyped_storage().nbytes()  # copied whole, as it is, each save
                continue
            storage = item.untyped_storage()
            storages[(str(item.device), storage.data_ptr(), storage.nbytes())] = item.device
        wanted = pageable
        for key, device in storages.items():
            if key in self._buffers:
                continue
            pageable += key[2]
            wanted += _power_of_two_at_least(key[2]) if self._wants_pinned(device) else key[2]
        return pageable, wanted

    def _new_buffer(self, nbytes: int, device: torch.device) -> torch.UntypedStorage:
        """A host buffer of ``nbytes``: pinned where wanted and possible (see the class doc), else pageable."""
        if self._pin_this_copy and self._wants_pinned(device):
            try:
                return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).untyped_storage()
            except RuntimeError as e:  # no pinned allocator (no CUDA), or page-locked memory refused
                self._pin_failed = True
                log.warning(
                    "Checkpoint copies go to pageable host memory from now on: pinning %s bytes failed (%s). "
                    "Background saves still work; a copy from the GPU is slower.",
                    f"{nbytes:,}",
                    str(e).splitlines()[0] if str(e) else type(e).__name__,
                )
        return torch.UntypedStorage(nbytes)

    def pinned_bytes(self) -> int:
        """The bytes of the last copy's buffers that are pinned host memory."""
        return sum(b.nbytes() for b in self._buffers.values() if b.is_pinned())

    def take(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """The copy; raises MemoryError, copying nothing, where its new buffers would take more than half the
        memory the host has available (a second copy of a large model's state must not bring on the kernel's
        out-of-memory killer; pinned memory, which cannot be swapped, all the more)."""
        from lightning_utilities.core.apply_func import apply_to_collection

        from gptlab.parallel.hardware import available_host_memory

        new, wanted = self._new_bytes(checkpoint)
        available = available_host_memory()
        if new > available / 2:
            raise MemoryError(
                f"a host copy needs {new / MB:,.0f} MB more, and {available / MB:,.0f} MB are available"
            )
        self._pin_this_copy = wanted <= available / 2
        if not self._pin_this_copy and not self._said_too_large:
            self._said_too_large = True
            log.warning(
                "This checkpoint's new host buffers are pageable: pinned ones would take %s MB (each rounded up to "
                "a power of two), more than half the %s MB of host memory available. A copy from the GPU into "
                "them is slower.",
                f"{wanted / MB:,.0f}",
                f"{available / MB:,.0f}",
            )
        used: dict[tuple[str, int, int], torch.UntypedStorage] = {}
        queued: set[torch.device] = set()  # the CUDA devices whose copies were queued without waiting

        def copy(tensor: torch.Tensor) -> torch.Tensor:
            if type(tensor) is not torch.Tensor or tensor.layout != torch.strided:
                return tensor.detach().to("cpu", copy=True)
            source = tensor.untyped_storage()
            key = (str(tensor.device), source.data_ptr(), source.nbytes())
            buffer = used.get(key)
            if buffer is None:
                buffer = self._buffers.get(key) or self._new_buffer(source.nbytes(), tensor.device)
                # From a GPU into pinned memory the copy is queued on the current stream, after the step
                # that wrote the tensor and before any later one: the values are the save's
                asynchronous = tensor.device.type == "cuda" and buffer.is_pinned()
                buffer.copy_(source, non_blocking=asynchronous)
                if asynchronous:
                    queued.add(tensor.device)
                used[key] = buffer
            view = torch.empty(0, dtype=tensor.dtype)
            return view.set_(buffer, tensor.storage_offset(), tensor.size(), tensor.stride())

        copied = apply_to_collection(checkpoint, torch.Tensor, copy)
        for device in queued:  # every copy on the host before the writer thread reads a byte
            torch.cuda.synchronize(device)
        self._buffers = used  # the buffers of storages gone since the last save are freed
        return copied


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes each checkpoint to a temporary file in the target's folder, fsyncs it, then renames it over the
    target with ``os.replace``: a process killed mid-write leaves the previous checkpoint intact (and at
    worst a stray ``.<name>.tmp-*`` file, which the next save of that name removes). The checkpoint's
    digest is written beside it once it is in place.

    Inside :meth:`in_background` a save returns once the checkpoint is copied to host memory
    (:class:`HostSnapshot`), and one worker thread writes, fsyncs, hashes and renames it while training goes
    on; :meth:`after_write` queues what must follow it. One write is in flight at most: the next save,
    :meth:`wait` and :meth:`teardown` wait for it first, and a write that failed (a full disk) raises its error
    there, or at :meth:`raise_if_failed`, polled once a step. A process killed while the thread writes leaves
    the previous checkpoint, as a kill during a save in the foreground does; a process that exits otherwise
    finishes the write first (the thread is joined at interpreter exit)."""

    def __init__(self) -> None:
        super().__init__()
        self._background = False
        self._worker: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None
        self._snapshot = HostSnapshot()
        self._foreground_only = False

    @contextmanager
    def in_background(self) -> Iterator[None]:
        """Saves made inside this block are written by the worker thread."""
        self._background = True
        try:
            yield
        finally:
            self._background = False

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options (got {storage_options!r}).")
        self.wait()  # one write at a time, and the host copy's buffers are free again
        if not self._background:
            self._write(checkpoint, Path(path))
            return
        if self._foreground_only:
            self._write(checkpoint, Path(path))
            return
        try:
            copy = self._snapshot.take(checkpoint)
        except (RuntimeError, MemoryError) as e:  # no host memory for a second copy: written now, from now on
            log.warning(
                "Checkpoints are written in the foreground from now on: no room for their copy in host memory, "
                "which a background write needs (%s).",
                e,
            )
            self._foreground_only = True
            self._snapshot = HostSnapshot()
            self._write(checkpoint, Path(path))
            return
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gptlab-checkpoint-writer")
        self._pending = self._worker.submit(self._write, copy, Path(path))

    @property
    def background_active(self) -> bool:
        """Whether saves made now go to the worker thread (inside :meth:`in_background`)."""
        return self._background and not self._foreground_only

    @property
    def pending_write(self) -> Future[None] | None:
        """The background write in flight (or finished and not yet waited for), None if there is none."""
        return self._pending

    def after_write(self, operation: Callable[[], None]) -> None:
        """Run ``operation`` (a file operation that must follow the checkpoint written in the background: the
        removal of the one it replaces, a record naming it) in the worker once that write is on disk; at once
        where no write is in flight. Where the write fails, the operation is not run: what is on disk stays as
        it was, and the write's error is raised as before."""
        previous = self._pending
        if previous is None or self._worker is None:
            operation()
            return

        def after() -> None:
            error = previous.exception()  # done: the worker runs its tasks in order
            if error is not None:
                raise error
            operation()

        self._pending = self._worker.submit(after)

    def wait(self) -> None:
        """Block until the write in flight, if any, is on disk; raise its error if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def raise_if_failed(self) -> None:
        """Raise the error of a background write that has failed; return at once otherwise."""
        if self._pending is not None and self._pending.done():
            self.wait()

    def teardown(self) -> None:
        try:
            self.wait()
        finally:
            if self._worker is not None:
                self._worker.shutdown(wait=True)
                self._worker = None
            self._snapshot = HostSnapshot()  # the host buffers go with the run
        super().teardown()

    def _write(self, checkpoint: dict[str, Any], target: Path) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        for stale in target.parent.glob(f".{target.name}.tmp-*"):
            if stale.is_file():
                stale.unlink(missing_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            files = digests.compute(Path(tmp_name), name=target.name)
            digests.remove_digest(target)
            if target.is_dir():  # a sharded checkpoint of the same name from an earlier run
                shutil.rmtree(target)
            os.replace(tmp_name, target)
        except BaseException as e:
            Path(tmp_name).unlink(missing_ok=True)
            full = disk_full(e, target, checkpoint) if isinstance(e, Exception) else None
            if full is not None:
                raise full from e
            raise
        fsync_dir(target.parent)
        digests.write_digest(target, files, step_of(checkpoint))
        fsync_dir(target.parent)

    def remove_checkpoint(self, path: Any) -> None:
        digests.remove_digest(Path(path))
        super().remove_checkpoint(path)


def link_checkpoint(source: Path, target: Path) -> bool:
    """Make ``target`` a second name of the checkpoint file ``source``: a hard link, made beside the target and
    renamed over it (what was there stays whole until then), with its digest beside it (the source's, under
    the new name). One file on disk for two names: a later save of either name writes a new file and renames
    it into place, which leaves the other name's bytes as they were. Returns False, changing nothing, where
    ``source`` is not a file (a sharded checkpoint) or the file system refuses hard links: the caller writes
    ``target`` itself. A symbolic link is not a fallback: removing or rewriting its target would change it."""
    source, target = Path(source), Path(target)
    if not source.is_file() or source.resolve() == target.resolve():
        return False
    tmp = target.parent / f".{target.name}.tmp-link-{os.getpid()}"  # a stray one goes with the next save
    try:
        tmp.unlink(missing_ok=True)
        os.link(source, tmp)
    except OSError as e:
        log.debug("no hard link from %s to %s (%s): writing it in full", source, target, e)
        tmp.unlink(missing_ok=True)
        return False
    try:
        manifest = digests.read_digest(source)
        written = manifest.files[0] if manifest is not None and len(manifest.files) == 1 else None
        if manifest is not None and written is not None and written.size == tmp.stat().st_size:
            files, step = [digests.FileDigest(target.name, written.size, written.sha256)], manifest.step
        else:  # a source without a digest: hash the bytes the link holds
            files, step = digests.compute(tmp, name=target.name), None
        digests.remove_digest(target)
        if target.is_dir():  # a sharded checkpoint of the same name from an earlier run
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(target.parent)
    digests.write_digest(target, files, step)
    fsync_dir(target.parent)
    return True


def _power_of_two_at_least(n: int) -> int:
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def step_of(checkpoint: dict[str, Any]) -> int | None:
    """The optimizer step a Lightning checkpoint holds, for its digest file."""
    step = checkpoint.get("global_step")
    return int(step) if isinstance(step, int) else None


MB = 1e6
# torch.save's C++ writer reports a failed write as "[enforce fail at inline_container.cc:...]"; written to a
# Python file object, the OSError (errno 28) is only in the exception's context.
_TORCH_WRITE_FAILED = ("inline_container", "PytorchStreamWriter failed", "file write failed")


def _errors_in_chain(error: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def tensor_bytes(value: Any) -> int:
    """The bytes of the tensors in a checkpoint's nested dicts and lists, each storage once (a tied embedding
    and head share one, as ``torch.save`` writes them): about the checkpoint's size on disk."""
    storages: dict[tuple[str, int], int] = {}
    for item in tensors_in(value):
        storage = item.untyped_storage()
        storages[(str(item.device), storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in a checkpoint's nested dicts, lists and tuples, in order."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item)


def disk_full(error: BaseException, target: Path, checkpoint: Any) -> Exception | None:
    """A DiskFullError naming the place, the space the checkpoint needs and what is free, and the last good
    checkpoint, when ``error`` (raised saving ``checkpoint`` to ``target``) is a full disk: errno 28 in its
    chain, or torch's write failure with less space free than the checkpoint needs. None otherwise."""
    from gptlab.errors import DiskFullError
    from gptlab.runs.layout import BEST_GLOB, LAST_CHECKPOINT, checkpoint_kind

    chain = _errors_in_chain(error)
    no_space = any(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in chain)
    needed = tensor_bytes(checkpoint)
    try:
        free = shutil.disk_usage(target.parent).free
    except OSError:
        return None
    torch_write = any(any(mark in str(e) for mark in _TORCH_WRITE_FAILED) for e in chain)
    if not (no_space or (torch_write and free < needed)):
        return None
    last_good = next((p for p in (target, target.parent / LAST_CHECKPOINT) if checkpoint_kind(p)), None)
    # before the first last checkpoint (saved every callbacks.last_checkpoint.every_n_steps), a best checkpoint of
    # a validation may already hold the run: the newest one is where it can go on from
    best = sorted(
        (p for p in target.parent.glob(BEST_GLOB) if p != target and checkpoint_kind(p)),
        key=lambda p: p.stat().st_mtime,
    )
    if last_good is not None:
        kept = f"the last good checkpoint {last_good} is intact: once there is space, resume=auto continues from it"
    elif best:
        kept = (
            f"no {LAST_CHECKPOINT} was written yet, and the best checkpoint {best[-1]} is intact: once there is "
            f"space, resume={best[-1]} continues from it"
        )
    else:
        kept = "no earlier checkpoint was written"
    return DiskFullError(
        f"no space left on {target.parent}: the checkpoint {target.name} needs about {_megabytes(needed)} MB, "
        f"{_megabytes(free)} MB free. Free space there, or start the run on another disk "
        f"(hydra.run.dir=<dir>); {kept}."
    )


def _megabytes(size: float) -> str:
    """Whole megabytes, or two decimals below one (a small model's checkpoint is not "0 MB")."""
    return f"{size / MB:,.0f}" if size >= MB else f"{size / MB:.2f}"


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            _fsync_file(path)
    fsync_dir(root)


def ranks_share_hashing(strategy: Any) -> bool:
    """Whether the ranks of ``strategy`` share the hashing of a sharded checkpoint (:func:`digests.compute_shared`,
    :func:`digests.check_shared`): a run of several processes with its process group up. One process hashes
    every file itself, as before."""
    return strategy.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()


def gather_objects(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order, on every rank (over the run's process group: its timeout,
    ``strategy.timeout_s``, bounds the wait for a rank that is lost, as for the save's barriers)."""
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, value)
    return gathered


def verify_sharded_load(strategy: Any, path: Path) -> None:
    """Check the sharded checkpoint ``path`` against its digest before ``strategy`` loads it, the hashing
    shared among the ranks: each rank checks its share, and every rank gets the same verdict, so a damaged
    shard found by one rank stops them all, each with the refusal one process gives
    (:func:`gptlab.runs.checkpoints.verify_checkpoint`). A resumed run's planning compared the sizes only
    (``resume.plan_resume(..., ranks_check_shards=True)``): the hashes are checked here, once the process
    group exists."""
    from gptlab.runs.checkpoints import RESUME_INSTEAD, verify_checkpoint

    if not (path.is_dir() and ranks_share_hashing(strategy)):
        return
    verdict = digests.check_shared(path, strategy.global_rank, strategy.world_size, gather_objects)
    if verdict.has_digest:  # one without was named by the planning's warning already
        verify_checkpoint(path, RESUME_INSTEAD, verdict=verdict)


def swap_in(staging: Path, target: Path) -> None:
    """Move the finished ``staging`` directory to ``target``, replacing what is there."""
    aside = target.parent / ASIDE.format(name=target.name)
    if aside.exists():
        remove_path(aside)
    if target.exists():
        os.rename(target, aside)
    os.rename(staging, target)
    fsync_dir(target.parent)
    if aside.exists():
        remove_path(aside)


def save_directory_atomically(
    strategy: Any, target: Path, write: Callable[[Path], None], step: int | None = None
) -> None:
    """Run the collective ``write(staging)`` on every rank of ``strategy``, hash its files (every rank its
    share, where there are several), then (rank 0) swap the staging directory in for ``target`` and write its
    digest (one line per file). Barriers keep every rank's shards inside the staging directory before the
    hashing, and every rank out of the save until the digest is written."""
    staging = target.parent / STAGING.format(name=target.name)
    if strategy.is_global_zero:
        target.parent.mkdir(parents=True, exist_ok=True)
        if staging.exists():  # left by a save that was killed
            remove_path(staging)
    strategy.barrier("gptlab_atomic_save_start")
    write(staging)
    strategy.barrier("gptlab_atomic_save_written")
    shared = ranks_share_hashing(strategy)
    if shared:  # each rank fsyncs and hashes its share of the files; every rank gets every digest
        files = digests.compute_shared(
            staging, target.name, strategy.global_rank, strategy.world_size, gather_objects, _fsync_file
        )
    if strategy.is_global_zero:
        if shared:
            fsync_dir(staging)
        else:
            _fsync_tree(staging)
            files = digests.compute(staging, name=target.name)
        digests.remove_digest(target)
        swap_in(staging, target)
        digests.write_digest(target, files, step)
        fsync_dir(target.parent)
    strategy.barrier("gptlab_atomic_save_done")


# The Lightning strategies that the sharded choices build: their checkpoint directories swapped in whole.


class FullyShardedStrategy(WatchedRanks, ModelParallelStrategy):
    """Lightning's ModelParallelStrategy with every rank in the data-parallel dimension (no tensor
    parallelism), carrying the FSDP options that `gptlab.parallel.transforms.parallelize` reads in
    `configure_model`; its ranks on a node are watched (`gptlab.parallel.ranks`)."""

    def __init__(self, reshard_after_forward: bool, hybrid: bool, cpu_offload: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.reshard_after_forward = reshard_after_forward
        self.hybrid = hybrid
        self.cpu_offload = cpu_offload
        if self._checkpoint_io is None:
            self._checkpoint_io = (
                AtomicCheckpointIO()
            )  # rank 0's single file (save_distributed_checkpoint=false)

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        target = Path(self.broadcast(filepath))
        save_directory_atomically(
            self,
            target,
            lambda staging: super(FullyShardedStrategy, self).save_checkpoint(checkpoint, staging),
            step_of(checkpoint),
        )

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        verify_sharded_load(self, path)
        if checkpoint_kind(path) == DCP:
            # saved with the vocabulary's rows (before model.vocab_multiple): fitted as it loads
            assert self.model is not None and self.lightning_module is not None
            fitted = load_fitting_vocab_rows(
                self.model, self.optimizers, path, self.lightning_module.strict_loading, weights_only
            )
            if fitted is not None:
                return fitted
        return super().load_checkpoint(checkpoint_path, weights_only)


class AtomicDeepSpeedStrategy(WatchedRanks, DeepSpeedStrategy):
    """Lightning's DeepSpeedStrategy whose checkpoint directories are written atomically, which reports
    the global gradient norm the DeepSpeed engine computed in its last step, and whose ranks on a node are
    watched (`gptlab.parallel.ranks`)."""

    def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options: Any | None = None) -> None:
        target = Path(self.broadcast(filepath))
        save_directory_atomically(
            self,
            target,
            lambda staging: super(AtomicDeepSpeedStrategy, self).save_checkpoint(
                checkpoint, staging, storage_options
            ),
            step_of(checkpoint),
        )

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        verify_sharded_load(self, Path(self.broadcast(checkpoint_path)))
        return super().load_checkpoint(checkpoint_path, weights_only)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            digests.remove_digest(Path(filepath))
        super().remove_checkpoint(filepath)

    def gradient_norm_after_step(self) -> float | None:
        """The L2 norm of all gradients of the last optimizer step, before clipping, over every rank's
        partition (ZeRO-2/3 keep gradients in flat partitioned buffers, so ``p.grad`` is None and the
        usual per-parameter norm sees nothing). None when the engine skipped the step (fp16 overflow)."""
        engine = getattr(self, "deepspeed_engine", None)
        if engine is None:
            return None
        norm = engine.get_global_grad_norm()
        if norm is None:
            return None
        return float(norm.item() if hasattr(norm, "item") else norm)
