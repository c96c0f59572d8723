"""SQLite store URLs and options."""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import parse_qsl

from ..._core.clock import duration
from ..._errors import ConfigurationError
from ._sql import DEFAULT_BUSY_TIMEOUT

_ACCEPTED = (
    "sqlite:///relative/path.db or sqlite:////absolute/path.db, optionally with "
    "?timeout=SECONDS and/or ?busy_timeout=SECONDS"
)
_OPTIONS = ("timeout", "busy_timeout")
_OPTIONS_TEXT = (
    "accepted: timeout (seconds, the bound on one call) and busy_timeout (seconds to "
    "wait for another writer; default: timeout)"
)


def parse(url: str, options: dict[str, Any]) -> tuple[str, float, float]:
    head, sep, rest = url.partition("://")
    if not sep or head.lower() != "sqlite":
        raise ConfigurationError(f"not an SQLite URL: {url!r}; use {_ACCEPTED}")
    location, _, query = rest.partition("?")
    if not location.startswith("/"):
        where = "no path" if not location else f"a host ({location.split('/', 1)[0]!r})"
        raise ConfigurationError(
            f"SQLite URL {url!r} has {where}; an SQLite file has no host: use {_ACCEPTED}"
        )
    path = location[1:]
    if not path or path.endswith("/"):
        raise ConfigurationError(
            f"SQLite URL {url!r} names no file; use {_ACCEPTED} (for example "
            "sqlite:////var/lib/app/idemlock.db)"
        )
    if path == ":memory:" or path.startswith("file:"):
        raise ConfigurationError(
            f"SQLite URL {url!r}: only a plain file path is accepted (an in-memory SQLite "
            "database is private to one connection); use memory:// for an in-process store"
        )
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise ConfigurationError(
            f"unknown SQLite store option(s) {', '.join(unknown)}; {_OPTIONS_TEXT}"
        )
    given: dict[str, Any] = {k: v for k, v in options.items() if v is not None}
    if query:
        try:
            pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=True)
        except ValueError as exc:
            raise ConfigurationError(
                f"SQLite URL {url!r} has a malformed query ({exc}); use {_ACCEPTED}"
            ) from exc
        for name, value in pairs:
            if name not in _OPTIONS:
                raise ConfigurationError(
                    f"SQLite URL {url!r} has unknown option {name!r}; {_OPTIONS_TEXT}"
                )
            if name in given:
                raise ConfigurationError(
                    f"{name} is given twice (in {url!r} and/or as a keyword); give it once"
                )
            given[name] = value
    timeout = _timeout(given.get("timeout"), "timeout")
    busy = _timeout(given["busy_timeout"], "busy_timeout") if "busy_timeout" in given else timeout
    # realpath: one file reached by two URLs (a symlink) shares its waiters' hub.
    return os.path.realpath(path), busy, timeout


def make_dir(path: str) -> bool:
    """Whether the store creates the directory of the file ``path``: only the default
    file's (in the user's state directory), when it does not exist yet. An explicit
    path's directory must exist, as for ``sqlite3``: creating it silently (as root:
    ``/var/lib/app/``) would hide a typo and leave directories nobody asked for."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(folder):
        return False
    if os.path.realpath(folder) == _default_dir():
        return True
    what = "is not a directory" if os.path.exists(folder) else "does not exist"
    raise ConfigurationError(
        f"SQLite store {path}: the directory {folder} {what}; create it first (owned by "
        "the user the processes sharing the store run as, e.g. mkdir -p), or give a path "
        "in an existing directory. Only the default file, in the user's state "
        "directory, has its directory created for it"
    )


def _default_dir() -> str:
    import platformdirs  # only for a path whose directory is missing

    return os.path.realpath(platformdirs.user_state_path("idemlock", appauthor=False))


def _timeout(given: Any, name: str) -> float:
    if given is None:
        return DEFAULT_BUSY_TIMEOUT
    return duration(given, f"the SQLite store option {name}", text=True)
