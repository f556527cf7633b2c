"""Python's cyclic garbage collector around a ``python train.py`` run: while it starts, and as it exits.

A run's start imports torch, Lightning, W&B and what they import: millions of objects that live as long as the
process. Python runs a full collection each time the objects that survived the last one have grown by a
quarter, and each full collection walks all of them again: 0.9 to 4.3 s of the 7 to 9 CPU seconds before the
first training step here went to them. While a run starts (:func:`freezing_while_starting`), what survives a full
collection is frozen (``gc.freeze``: moved where collections do not look), so that the next one walks only
what came after; once the task's loop begins (:func:`startup_over`) nothing more is frozen and the collector
works as Python's default, and when the run ends everything is handed back to it (``gc.unfreeze``), so that a
process running several jobs (a sweep) collects each job's garbage. Freezing changes no value: an object is
still released when its last reference goes, and only a cycle that becomes garbage while frozen waits for
the run's end (a start-up's temporaries, not its data or model).

At the process's exit (:func:`exit_without_collecting`), the interpreter clears every module and collects
again over all that is left: 1 to 3 s after the run's last line, for memory the system takes back anyway.
"""

from __future__ import annotations

import atexit
import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def _freeze_survivors(phase: str, info: dict[str, Any]) -> None:
    if phase == "stop" and info.get("generation") == 2:
        gc.freeze()


@contextmanager
def freezing_while_starting() -> Iterator[None]:
    """Around one run (one job of a sweep): the survivors of each full collection are frozen until
    :func:`startup_over`, and handed back to the collector when the run ends, however it ends. A process that
    froze objects itself (before forking workers, say) or turned the collector off manages it: left alone."""
    ours = gc.isenabled() and gc.get_freeze_count() == 0 and _freeze_survivors not in gc.callbacks
    if ours:
        gc.callbacks.append(_freeze_survivors)
    try:
        yield
    finally:
        if ours:
            startup_over()
            gc.unfreeze()


def startup_over() -> None:
    """The task's loop begins: nothing more is frozen (what is frozen stays so until the run ends). Called by
    the run skeleton once the run's config is logged, the last step before training; a no-op outside
    :func:`freezing_while_starting`."""
    if _freeze_survivors in gc.callbacks:
        gc.callbacks.remove(_freeze_survivors)


def exit_without_collecting() -> None:
    """Freeze every object as the process's exit begins (an exit handler), so that the interpreter's last
    collections walk none of them; the exit handlers (W&B's, logging's flush) run as before, and each object is
    still released when its module is cleared. Registered once per process: a process that runs ``train.py``
    several times in itself (the docs' tests) is frozen at its own exit only."""
    global _exit_registered
    if not _exit_registered:
        atexit.register(gc.freeze)
        _exit_registered = True


_exit_registered = False
