"""The JSON files of a run directory (its result, its identity, the scores of its best checkpoints: the
names are :mod:`gptlab.runs.layout`'s; word2vec's ``metrics.json`` and ``evaluation.json``; the studies'
``length.json``, ``passkey.json`` and lm-eval's ``results.json`` with its samples) and every other JSON file
gptlab writes (a sweep's ``length_summary.json`` and ``scaling.json``, the scripts' reports), written as
strict JSON that any reader parses (jq, JavaScript's ``JSON.parse``, a dashboard), and their numbers read
back.

JSON has no NaN or infinity: Python's ``json`` writes them as the bare tokens ``NaN`` and ``Infinity``, which
every strict parser refuses, and with them the whole file. The project's one convention for a figure:

- a finite number is a JSON number;
- a figure that was measured and is not finite (a diverged run's ``val/loss``) is the string ``"inf"``,
  ``"-inf"`` or ``"nan"``, as Lightning's CSV writes it (Python's ``float()`` reads it back);
- a figure that is missing (not measured: the scores of word vectors whose evaluation a stop signal ended)
  is ``null``, and the file names it beside with the reason (``evaluation_missing``).

Every writer here refuses NaN and infinity (``allow_nan=False``): a writer converts the figures it knows may
be non-finite with :func:`figures_as_json`, and any other non-finite number raises ``ValueError`` (in the
tests) rather than writing a file no strict reader opens; a file whose every number is a figure (a study's
results) is converted whole with :func:`all_figures_as_json` and read back with :func:`figures_from_json`.
Files written before this convention, holding bare ``NaN`` tokens, still read: Python's ``json`` parses
them, and :func:`read_figure` reads every form.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any


def figure_as_json(value: Any) -> float | str | None:
    """One figure as the convention writes it: a finite number as itself (an int stays an int), a non-finite
    one as ``"inf"``, ``"-inf"`` or ``"nan"``, a missing one (None) as None (``null``). A figure read back
    from a file (:func:`read_figure`'s forms) is written again the same way."""
    if value is None or isinstance(value, (bool, int)):
        return value
    value = read_figure(value) if isinstance(value, str) else float(value)
    if value is None or math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else "inf" if value > 0 else "-inf"


def figures_as_json(figures: Mapping[str, Any]) -> dict[str, float | str | None]:
    """A map of figures (metrics, scores) as the convention writes them (:func:`figure_as_json`)."""
    return {name: figure_as_json(value) for name, value in figures.items()}


def all_figures_as_json(data: Any, default: Callable[[Any], Any] | None = None) -> Any:
    """``data`` (dicts, lists and tuples of JSON values, nested) with every float in it as
    :func:`figure_as_json` writes it, for files whose every number is a figure (a study's results, a harness's
    scores); strings, ints, bools and None are kept as they are. ``default``: what an object JSON has no form
    for becomes (a numpy scalar, a set), converted in turn; without it such an object raises ``TypeError``."""
    if isinstance(data, float):
        return figure_as_json(data)
    if data is None or isinstance(data, (str, int, bool)):
        return data
    if isinstance(data, Mapping):
        return {key: all_figures_as_json(value, default) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [all_figures_as_json(value, default) for value in data]
    if default is None:
        raise TypeError(f"{type(data).__name__} {data!r} has no JSON form")
    return all_figures_as_json(default(data), default)


def figures_from_json(data: Any) -> Any:
    """``data`` as read from a file of this convention with every non-finite figure's string (``"inf"``,
    ``"nan"``, ...) back as its float, anywhere in it (nested dicts and lists): what the file's readers had
    from an older file's bare tokens. A missing figure (``null``) stays None; other strings are kept."""
    if isinstance(data, str):
        return float(data) if data.strip().lower() in NON_FINITE_TEXT else data
    if isinstance(data, dict):
        return {key: figures_from_json(value) for key, value in data.items()}
    if isinstance(data, list):
        return [figures_from_json(value) for value in data]
    return data


# How a non-finite figure may be spelled: this convention's, and what other writers (Lightning's CSV, numpy,
# JavaScript) write.
NON_FINITE_TEXT = frozenset({"inf", "+inf", "-inf", "nan", "infinity", "+infinity", "-infinity"})


def read_figure(value: Any) -> float | None:
    """A figure as written in a run's JSON file, read back: a number as a float (a bare ``NaN`` or
    ``Infinity`` of an older file included), ``"inf"``, ``"-inf"`` and ``"nan"`` as those floats, and None
    for a missing one (``null``) or anything that is no figure (a bool, another string, a list)."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value.strip().lower() in NON_FINITE_TEXT:
        return float(value)
    return None


def dumps(data: Any, indent: int | None = 1, sort_keys: bool = False) -> str:
    """``data`` as strict JSON; raises ``ValueError`` on a NaN or an infinity (convert figures first with
    :func:`figures_as_json`)."""
    return json.dumps(data, indent=indent, sort_keys=sort_keys, allow_nan=False)


def write_json(path: str | Path, data: Any, sort_keys: bool = False) -> Path:
    """Write ``data`` to ``path`` as strict JSON (:func:`dumps`), whole or not at all: a temporary file beside
    it renamed over it, removed again when the write fails (a full disk, a NaN). Nothing is written when
    ``data`` does not serialize."""
    return _write_whole(
        Path(path), dumps(data, sort_keys=sort_keys)
    )  # a NaN raises before any file is touched


def write_json_lines(path: str | Path, rows: Iterable[Any]) -> Path:
    """Write ``rows`` to ``path`` one strict JSON value a line (JSON Lines: an lm-eval task's samples), whole
    or not at all, as :func:`write_json` does."""
    return _write_whole(Path(path), "".join(dumps(row, indent=None) + "\n" for row in rows))


def _write_whole(path: Path, text: str) -> Path:
    """``text`` to ``path`` through a temporary file beside it renamed over it (removed when the write fails)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
