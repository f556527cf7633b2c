"""The stop signals a run catches (SIGTERM, and SIGINT: Ctrl-C) while it can still stop cleanly: both tasks
(the language model's run skeleton, :mod:`gptlab.tasks.skeleton`, and word2vec's trainer,
:mod:`gptlab.word2vec.task`) use the one class, which stands below both."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gptlab.errors import EvaluationStopped


class StopSignals:
    """SIGTERM and SIGINT (Ctrl-C) caught while it is installed (``with signals:``): each is noted
    (``received``, the first one kept) and acted on where the run can stop cleanly. Work outside
    :meth:`interrupting` (a checkpoint, ``embeddings.txt``, ``length.json``) is finished and written whole;
    inside it (an evaluation after training, minutes on a large vocabulary or a long context) a signal ends the
    work at once with :class:`~gptlab.errors.EvaluationStopped`. word2vec's trainer also stops at its next
    checkpoint. Handlers can be set in the main thread only: elsewhere nothing is caught."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: int | None = None
        self._interrupting = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.getsignal(s)
                signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signum
        if self._interrupting:
            self._interrupting = False
            raise EvaluationStopped(signum)

    @contextmanager
    def interrupting(self) -> Iterator[None]:
        """Work a signal ends at once (:class:`~gptlab.errors.EvaluationStopped`), or never starts when one
        came before."""
        if self.received is not None:
            raise EvaluationStopped(self.received)
        self._interrupting = True
        try:
            yield
        finally:
            self._interrupting = False
