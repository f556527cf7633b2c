"""Errors that gptlab raises for bad input: each names the bad value, what is allowed, and the fix."""


class ConfigError(ValueError):
    """A configuration value that cannot work, found before any expensive work starts."""


class DataError(ValueError):
    """A corpus or data file that cannot be used as given."""


class CheckpointError(ConfigError):
    """A checkpoint that cannot be read, that is not gptlab's, or that belongs to a different model."""
