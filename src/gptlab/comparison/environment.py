"""Where the runs of a comparison differ in what their numbers depend on beyond their settings.

A table says whether the difference between two conditions is beyond seed noise; it assumes that the runs
differ only in the keys that define a condition. Runs made with another thread count, torch, device,
precision or commit can differ by more than their seeds do (torch.optim.Muon's bf16 Newton-Schulz magnifies
a last-bit difference: docs/studies.md). Each run records its environment (:mod:`gptlab.runs.environment`);
here the comparison names each field whose values differ between its ranked runs, with the rows that hold
each value, under the table. Runs that all share their environment get no note; runs from before the record
are said to be "not recorded" once (nothing when no run recorded it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gptlab.comparison.records import RunRecord
from gptlab.comparison.table import Row
from gptlab.runs.environment import FIELDS, value_text

ENVIRONMENT_HEADER = (
    "The runs differ in their environment, not only in their settings: differences between the rows named "
    "here include the environment (a row named under two values differs within its seeds)."
)


def rows_phrase(numbers: Sequence[int]) -> str:
    """``row 3``, ``rows 1-2``, ``rows 1-3, 5``: table row numbers, runs of consecutive ones as ranges."""
    spans: list[list[int]] = []
    for n in sorted(set(numbers)):
        if spans and n == spans[-1][-1] + 1:
            spans[-1].append(n)
        else:
            spans.append([n])
    text = ", ".join(f"{s[0]}-{s[-1]}" if len(s) > 1 else str(s[0]) for s in spans)
    return f"row{'s' if len(set(numbers)) > 1 else ''} {text}"


def environment_notes(rows: Sequence[Row]) -> list[str]:
    """The note under the table for the fields in which its ranked runs' environments differ, between rows
    or within a row's seeds: ``torch threads: 1 in rows 1-2, 2 in row 3``. Empty when they share one, or
    when none recorded it; runs that did not record it, beside runs that did, are named once."""
    recorded: dict[str, dict[str, list[int]]] = {field: {} for field in FIELDS}
    unrecorded: list[int] = []
    total = missing = 0
    for number, row in enumerate(rows, 1):
        for run in row.runs:
            total += 1
            if run.environment is None:
                missing += 1
                unrecorded.append(number)
                continue
            for field in FIELDS:
                text = value_text(field, run.environment.get(field))
                holders = recorded[field].setdefault(text, [])
                if number not in holders:
                    holders.append(number)
    if missing == total:
        return []
    lines = []
    for field, label in FIELDS.items():
        values = recorded[field]
        if len(values) > 1:
            lines.append(
                f"- {label}: "
                + ", ".join(f"{text} in {rows_phrase(numbers)}" for text, numbers in values.items())
            )
    if missing:
        lines.append(
            f"- not recorded by {missing} of the {total} runs ({rows_phrase(unrecorded)}: made before gptlab "
            "recorded the environment): they may differ in it too"
        )
    if not lines:
        return []
    return [ENVIRONMENT_HEADER + "\n\n" + "\n".join(lines)]


def shared_environment(runs: Sequence[RunRecord]) -> str | None:
    """The environment every one of ``runs`` recorded alike, in words (for the "Trained with" line): the
    fields they share, the commit left to that line; None when a run recorded none or they share nothing."""
    if not runs or any(run.environment is None for run in runs):
        return None
    shared: dict[str, Any] = {}
    for field in FIELDS:
        if field == "commit":
            continue
        values = {value_text(field, run.environment.get(field)) for run in runs if run.environment}
        if len(values) == 1:
            shared[field] = values.pop()
    if not shared:
        return None
    return ", ".join(f"{FIELDS[field]} {text}" for field, text in shared.items())
