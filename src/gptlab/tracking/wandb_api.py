"""Read runs through the W&B public API (online runs; needs the network and a login). Offline runs, which
the API cannot see, are read from their files by :mod:`gptlab.tracking.wandb_files`."""

from __future__ import annotations

from typing import Any


def group_runs(project: str, group: str) -> Any:
    """The runs of one W&B group (``project`` as ``entity/project``): ``wandb.apis.public.Run`` objects,
    fetched lazily as they are iterated."""
    import wandb

    return wandb.Api().runs(project, filters={"group": group})
