"""Every exception gptlab raises on purpose. Each message names the bad value, what is allowed, and the fix.

``ConfigError`` and its kinds end `python train.py` with exit status 2 and the message alone (no traceback);
``NonFiniteLossError``, ``DiskFullError`` and ``RankLostError`` end it with status 1, as a run that started and
then failed.
"""


class ConfigError(ValueError):
    """A configuration value that cannot work, found before any expensive work starts."""


class DataError(ValueError):
    """A corpus or data file that cannot be used as given."""


class CheckpointError(ConfigError):
    """A checkpoint that cannot be read, that is not gptlab's, or that belongs to a different model."""


class WandbFileError(ValueError):
    """A W&B run file (``run-*.wandb``) that cannot be read: not one, truncated, or corrupt."""


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite on some rank; every rank stops at the same step, before the
    bad state is stepped or saved."""


class DiskFullError(RuntimeError):
    """A checkpoint could not be written for want of space; the message names the place, the space needed
    and free, and the last good checkpoint (a failed save never replaces it)."""


class RankLostError(RuntimeError):
    """A process of a distributed run ended (killed, crashed) or its launching process is gone; the message
    names the rank and how it ended, the last intact checkpoint and the command that continues the run."""


__all__ = [
    "CheckpointError",
    "ConfigError",
    "DataError",
    "DiskFullError",
    "NonFiniteLossError",
    "RankLostError",
    "WandbFileError",
]
