"""Whether W&B can take this run online, decided before the run starts.

W&B logs online when ``WANDB_MODE=online`` (or ``logger.wandb.mode=online``) says so, or, with ``mode: auto``,
when the user is logged in. Left to ``wandb.init``, an online run without a key fails some 20 s in with a
traceback, and a wrong key or an unreachable server hangs about 90 s. Here, at config time (a Hydra callback,
before the run directory is claimed or written, and again where the W&B logger is made): no key is a
:class:`~gptlab.errors.ConfigError` at once, and a key is tried against the server with a short timeout
(one request for the key's user), so that a rejected key or a server out of reach is a refusal within
seconds, with the ways on. Nothing here imports wandb or Lightning.
"""

from __future__ import annotations

import base64
import configparser
import json
import netrc
import os
import socket
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast
from urllib.parse import urlparse

from hydra.experimental.callback import Callback as HydraCallback

from gptlab.errors import ConfigError

#: The ``_target_`` of the W&B logger's config node (conf/logger/wandb.yaml).
WANDB_LOGGER_TARGET = "gptlab.tracking.loggers.wandb_logger"
DEFAULT_BASE_URL = "https://api.wandb.ai"
#: Seconds the check waits for the W&B server: a working connection answers in well under one.
CHECK_TIMEOUT_S = 5.0

FIXES = (
    "log in with `wandb login` (or set WANDB_API_KEY); or run without W&B: logger=csv; or keep the W&B run "
    "as local files: WANDB_MODE=offline (upload it later with `wandb sync <run dir>/wandb/offline-run-*`)"
)


def _settings_file() -> Path:
    folder = os.environ.get("WANDB_CONFIG_DIR") or os.path.join(os.path.expanduser("~"), ".config", "wandb")
    return Path(folder) / "settings"


def _setting(key: str) -> str | None:
    """A value from W&B's global settings file (``wandb login`` and ``wandb init`` write it)."""
    parser = configparser.ConfigParser()
    try:
        parser.read(_settings_file())
    except (OSError, configparser.Error):
        return None
    return parser.get("default", key, fallback=None) or None


def wandb_base_url() -> str:
    """The W&B server this process would log to."""
    return (os.environ.get("WANDB_BASE_URL") or _setting("base_url") or DEFAULT_BASE_URL).rstrip("/")


def _netrc_path() -> str:
    return os.environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")


@dataclass(frozen=True)
class WandbKey:
    value: str
    source: str  # where it was found, for the message: WANDB_API_KEY, ~/.netrc, the settings file


def wandb_api_key() -> WandbKey | None:
    """The API key W&B would use for :func:`wandb_base_url`: WANDB_API_KEY, a netrc entry for the host, or
    the settings file's; None when there is none. (An identity-token file, WANDB_IDENTITY_TOKEN_FILE, is
    counted as a key as it is.)"""
    if os.environ.get("WANDB_API_KEY"):
        return WandbKey(os.environ["WANDB_API_KEY"], "WANDB_API_KEY")
    if os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return WandbKey("", "WANDB_IDENTITY_TOKEN_FILE")
    host = urlparse(wandb_base_url()).hostname or "api.wandb.ai"
    path = _netrc_path()
    try:
        entry = netrc.netrc(path).authenticators(host)
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        entry = None
    if entry and entry[2]:
        return WandbKey(entry[2], path)
    key = _setting("api_key")
    return WandbKey(key, str(_settings_file())) if key else None


def wandb_logged_in() -> bool:
    """True when W&B credentials are present (WANDB_API_KEY, a netrc entry for the W&B host, or settings)."""
    return wandb_api_key() is not None


def wandb_mode(mode: str | None) -> Literal["online", "offline", "disabled"]:
    """``online``, ``offline`` or ``disabled``: the configured mode, else WANDB_MODE, else online exactly when
    the user is logged in."""
    allowed = ("online", "offline", "disabled")
    if mode in (None, "auto"):
        env = os.environ.get("WANDB_MODE")
        if env in ("dryrun",):
            env = "offline"
        mode = env if env in allowed else ("online" if wandb_logged_in() else "offline")
    if mode not in allowed:
        raise ConfigError(f"logger.wandb.mode={mode!r} is not one of {allowed} (or auto / null).")
    return cast(Literal["online", "offline", "disabled"], mode)


def _why_online(mode: str | None) -> str:
    if mode not in (None, "auto"):
        return f"logger.wandb.mode={mode}"
    if os.environ.get("WANDB_MODE") in ("online",):
        return "WANDB_MODE=online"
    return "logger.wandb.mode=auto (a W&B key is present)"


def probe_wandb(base_url: str, key: str, timeout: float = CHECK_TIMEOUT_S) -> str | None:
    """Ask the W&B server at ``base_url`` who ``key`` belongs to, waiting at most about ``timeout`` seconds;
    None when it answers with a user, else what went wrong, as a sentence."""
    body = json.dumps({"query": "query Viewer { viewer { id } }"}).encode()
    token = base64.b64encode(f"api:{key}".encode()).decode()
    request = urllib.request.Request(
        f"{base_url}/graphql",
        data=body,
        headers={"Content-Type": "application/json", "Authorization": f"Basic {token}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            answer = json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as e:
        if e.code in (401, 403):
            return f"the W&B server at {base_url} rejected the API key (HTTP {e.code})"
        return f"the W&B server at {base_url} answered HTTP {e.code}"
    except TimeoutError:
        return f"the W&B server at {base_url} did not answer within {timeout:g} s"
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, (TimeoutError, socket.timeout)):
            return f"the W&B server at {base_url} did not answer within {timeout:g} s"
        return f"the W&B server at {base_url} cannot be reached ({reason})"
    except ValueError:
        return f"the W&B server at {base_url} did not answer as a W&B server does"
    viewer = (answer.get("data") or {}).get("viewer") if isinstance(answer, dict) else None
    if not viewer:
        return f"the W&B server at {base_url} knows no user with this API key"
    return None


# The (server, key) pairs this process has found working: the logger does not ask again after the callback.
_working: set[tuple[str, str]] = set()


def check_wandb_online(mode: str | None = None, timeout: float = CHECK_TIMEOUT_S) -> None:
    """Refuse (a :class:`ConfigError`) an online W&B run that cannot log: no key, or a key the server
    rejects or cannot be asked about within ``timeout`` seconds. Nothing to do offline or disabled, nor on
    the ranks a launcher started (rank 0 checked; only rank 0 logs to W&B)."""
    from gptlab.runs.identity import launched_rank

    if wandb_mode(mode) != "online" or launched_rank():
        return
    why = _why_online(mode)
    key = wandb_api_key()
    if key is None:
        raise ConfigError(
            f"W&B is to log online ({why}) but no W&B API key is set (no WANDB_API_KEY, no entry for "
            f"{urlparse(wandb_base_url()).hostname} in {_netrc_path()}, none in W&B's settings): the run would fail "
            f"at its start. To go on: {FIXES}."
        )
    if not key.value:  # an identity-token file: W&B exchanges it itself
        return
    base_url = wandb_base_url()
    if (base_url, key.value) in _working:
        return
    problem = probe_wandb(base_url, key.value, timeout)
    if problem is not None:
        raise ConfigError(
            f"W&B is to log online ({why}, key from {key.source}) but {problem}: the run would hang or fail "
            f"at its start. Check the key and WANDB_BASE_URL, or to go on: {FIXES}."
        )
    _working.add((base_url, key.value))


def wandb_modes_of(logger_nodes: Any) -> list[str | None]:
    """The ``mode`` of each W&B logger node among ``logger_nodes`` (the config's ``logger`` node)."""
    modes: list[str | None] = []
    for node in (logger_nodes or {}).values():
        if node is not None and hasattr(node, "get") and node.get("_target_") == WANDB_LOGGER_TARGET:
            mode = node.get("mode")
            modes.append(None if mode is None else str(mode))
    return modes


class CheckWandb(HydraCallback):
    """A Hydra callback, before the run directory is chosen, claimed or written (and once before a sweep's
    first job): an online W&B logger that cannot log is refused here, in seconds."""

    def _check(self, config: Any) -> None:
        try:
            for mode in wandb_modes_of(config.get("logger")):
                check_wandb_online(mode)
        except ConfigError as e:
            print(f"\ngptlab: error: {e}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        self._check(config)

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        self._check(config)
