"""From a URL (or an existing client) to a store adapter.

Each scheme maps to a module and a function ``open_sync(url, **options)`` /
``open_async(url, **options)`` in it; the module (and so the store's driver) is
imported only when that scheme is used.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import os
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, unquote_plus

from ._core.clock import Clock, duration
from ._errors import ConfigurationError, IdemlockError

#: scheme -> module that implements it
SCHEMES: dict[str, str] = {
    "memory": "idemlock.stores.memory",
    "sqlite": "idemlock.stores.sqlite",
    "redis": "idemlock.stores.redis",
    "rediss": "idemlock.stores.redis",
    "unix": "idemlock.stores.redis",
    "redis+cluster": "idemlock.stores.redis",
    "rediss+cluster": "idemlock.stores.redis",
    "redis+sentinel": "idemlock.stores.redis",
    "rediss+sentinel": "idemlock.stores.redis",
    "postgresql": "idemlock.stores.postgres",
    "postgres": "idemlock.stores.postgres",
    "etcd": "idemlock.stores.etcd",
    "etcds": "idemlock.stores.etcd",
}

#: client class module prefix -> store module, for passing an existing client
CLIENT_MODULES: dict[str, str] = {
    "redis": "idemlock.stores.redis",
    "psycopg_pool": "idemlock.stores.postgres",
}


def default_url() -> str:
    """``$IDEMLOCK_URL``, else a SQLite file in the user's state directory."""
    env = os.environ.get("IDEMLOCK_URL")
    if env:
        return env
    import platformdirs

    path = platformdirs.user_state_path("idemlock", appauthor=False) / "idemlock.db"
    return f"sqlite:///{path}"


def _accepted() -> str:
    return ", ".join(f"{s}://" for s in SCHEMES)


def open_store(url: Any, *, asynchronous: bool, **options: Any) -> tuple[Any, Clock | None, str]:
    """Return (store, clock the store judges time by or None, URL to show)."""
    if url is not None and not isinstance(url, str):
        modname = CLIENT_MODULES.get(type(url).__module__.split(".")[0])
        if modname is None:
            raise ConfigurationError(
                f"cannot build a store from a {type(url).__module__}.{type(url).__name__}; "
                f"pass a URL ({_accepted()}) or a redis-py client or a psycopg_pool pool"
            )
        mod = importlib.import_module(modname)
        check_options(mod.from_client, options, f"a store built from a {type(url).__name__}")
        options = store_durations("", options)
        store, clock = mod.from_client(url, asynchronous=asynchronous, **options)
        return store, clock, f"<{type(url).__name__}>"
    if url is None:
        url = default_url()
    if "://" not in url:
        raise ConfigurationError(
            f"store URL {redact(url)!r} has no scheme; use one of {_accepted()} "
            "(for example sqlite:///var/lib/app/idemlock.db)"
        )
    head = url.split("://", 1)[0]
    modname = SCHEMES.get(head.lower())
    if modname is None:
        raise ConfigurationError(
            f"unknown store URL scheme {redact(head)!r} in {redact(url)!r}; "
            f"accepted schemes: {_accepted()}"
        )
    try:
        mod = importlib.import_module(modname)
    except ImportError as exc:
        raise driver_error(modname.rsplit(".", 1)[-1], exc) from exc
    if modname == "idemlock.stores.postgres":
        # libpq would read the password's pieces as the host, port and database name.
        refuse_unencoded_password(url, "PostgreSQL URL", libpq=True)
    opener = mod.open_async if asynchronous else mod.open_sync
    check_options(opener, options, f"the {head.lower()}:// store")
    options = store_durations(url, options)
    try:
        store, clock = opener(url, **options)
    except IdemlockError as exc:
        # Whatever a store's parser quotes, no secret of the URL leaves in a message,
        # nor in an exception it chains (a traceback prints those too).
        clean = _scrubbed(exc, url)
        if clean is None:
            raise
    else:
        return store, clock, redact(url)
    raise clean  # outside the except: the original does not ride along as __context__


def driver_error(store: str, exc: ImportError) -> ConfigurationError:
    """The error for a store module that failed to import: what failed, and what to
    install (for PostgreSQL a missing libpq fails too, which the extra does not bring)."""
    what = " ".join(str(exc).split())  # psycopg's text spans several lines
    if store == "postgres":
        return ConfigurationError(
            f"the postgres store cannot be loaded: {type(exc).__name__}: {what}. It needs "
            "psycopg and psycopg-pool (pip install 'idemlock[postgres]') and the libpq "
            "library: install libpq (e.g. apt-get install libpq5) or pip install "
            "'psycopg[binary]', which bundles it"
        )
    if store in ("redis", "etcd"):
        return ConfigurationError(
            f"the {store} store cannot be loaded: {type(exc).__name__}: {what}; install "
            f"its driver: pip install 'idemlock[{store}]'"
        )
    return ConfigurationError(
        f"the {store} store cannot be loaded: {type(exc).__name__}: {what}; it needs no "
        "extra, so this installation of idemlock is broken: reinstall it"
    )


#: store options that are durations, the same on every store (A1), and whether zero is
#: refused: checked here once, by the one duration validator, before any store sees them
STORE_DURATIONS = {
    "timeout": ("the bound on one store call", True),
    "busy_timeout": ("how long SQLite waits for another writer", False),
    "counter_ttl": ("how long Redis keeps a key's fence counter after its last use", True),
}


def store_durations(url: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with each store duration as float seconds (a ``timedelta``, int,
    float or numeric string is accepted); NaN, infinity, negative values, zero for
    ``timeout`` and more than ``MAX_TTL`` raise ConfigurationError, in a keyword and
    in the URL's query alike, so every store gives the same answer."""
    out = dict(options)
    query = url.partition("?")[2].partition("#")[0]
    given = {k: v for k, v in parse_qsl(query, keep_blank_values=True)} if query else {}
    for name, (meaning, positive) in STORE_DURATIONS.items():
        what = f"the store option {name} (seconds, {meaning})"
        if name in out:
            out[name] = duration(out[name], what, positive=positive, text=True)
        if name in given:  # left in the URL for the store to read; only checked here
            duration(given[name], what, positive=positive, text=True)
    return out


#: options of connect() that configure the coordinator, not the store
COORDINATOR_OPTIONS = (
    "key_prefix",
    "keyring",
    "tenant",
    "max_result_bytes",
    "compress_over",
    "hooks",
)


def check_options(fn: Callable[..., Any], options: dict[str, Any], what: str) -> None:
    """Refuse options that ``fn`` (a store's opener) does not take, naming those it
    does, instead of the raw TypeError of the call. An opener that takes ``**options``
    checks them itself."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    accepted = [p.name for p in params if p.kind is p.KEYWORD_ONLY]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ConfigurationError(
            f"unknown option(s) {', '.join(map(repr, unknown))} for {what}; it accepts "
            f"{', '.join(accepted) or 'no options'} (and connect() itself takes "
            f"{', '.join(COORDINATOR_OPTIONS)})"
        )


#: Words that make a query parameter (or a ``key=value`` of a libpq DSN) a secret:
#: password=, passwd=, pass=, pwd=, sslpassword=, ssl_password=, secret=,
#: client_secret=, token=, access_token=, auth=, auth_token=, apikey=, api_key=, ...
_SECRET_WORDS = ("pass", "pwd", "secret", "token", "auth", "apikey", "api_key", "credential")
# name=value where the name starts a parameter (start, ?, &, ; or whitespace).
_PARAM = re.compile(r"(^|[?&;\s])([^=?&;#\s]+)=('[^']*'|[^&;#\s]*)")
MASK = "***"


def _secret_name(name: str) -> bool:
    low = unquote_plus(name).lower()
    return any(word in low for word in _SECRET_WORDS)


#: what may follow the @ that ends a userinfo, up to the path: host[:port][,host...]
_HOSTS = re.compile(r"[A-Za-z0-9\-._~%:\[\],]*")


def _host_follows(rest: str, at: int) -> bool:
    tail = rest[at + 1 :]
    end = min((i for i in (tail.find(c) for c in "/?#") if i >= 0), default=len(tail))
    return _HOSTS.fullmatch(tail[:end]) is not None


def _userinfo(rest: str) -> tuple[str, str]:
    """(userinfo, what follows its @) of the part of a URL after ``://``; ("", rest)
    without one.

    A userinfo cannot legally hold a raw @, /, ? or #, but a password pasted into a
    URL may: so when the text before the first /, ? or # holds a ``:`` (a password
    starts there), the userinfo runs to the last @ that a host part follows, whatever
    it holds (``redis://u:pa#ss@h`` -> ``u:pa#ss``). The cost: the rare URL with a
    ``host:port`` and an @ in its query (``?user=me@corp``) is masked as if it were
    one. With no ``:`` there, an @ after a / ? # is path or query text
    (``sqlite:////tmp/a@b.db``)."""
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    extend = ":" in rest[:end]
    ats = [i for i, c in enumerate(rest) if c == "@" and (i < end or extend)]
    if not ats:
        return "", rest
    hosted = [i for i in ats if _host_follows(rest, i)]
    if hosted:
        at = hosted[-1]
    elif ats[0] < end:  # no host after any: the legal reading, the last @ before the path
        at = max(i for i in ats if i < end)
    else:
        return "", rest
    return rest[:at], rest[at + 1 :]


def unencoded_password(url: str, *, libpq: bool = False) -> bool:
    """Whether the password of ``url`` seems to hold a raw /, ? or # (an @ ending a
    userinfo follows one of them), which a URL parser reads as the start of the path,
    query or fragment: the host, port and path it then finds are pieces of the
    password. ``libpq``: as libpq reads a URL, which takes a raw ? or # in a password
    and is misled only by a / that no ? follows before the @ (then the @ lands in the
    database name)."""
    if not isinstance(url, str):
        return False
    userinfo = _userinfo(url.partition("://")[2])[0]
    if libpq:
        slash = userinfo.find("/")
        return slash >= 0 and "?" not in userinfo[slash:]
    return any(c in userinfo for c in "/?#")


def refuse_unencoded_password(url: str, what: str, *, libpq: bool = False) -> None:
    """Raise ConfigurationError, showing no piece of the password, if ``url`` seems to
    hold one with a raw /, ? or # (see :func:`unencoded_password`)."""
    if unencoded_password(url, libpq=libpq):
        raise ConfigurationError(
            f"{what} {redact(url)!r} has an '@' after a '/', '?' or '#', so its password "
            "seems to contain one of them: percent-encode them in the password (%2F, "
            "%3F, %23; an '@' as %40), and write an '@' of the path or query as %40"
        )


def redact(url: str) -> str:
    """``url`` as it may be shown (``coord.url``, messages, the CLI): the password of
    the userinfo and the value of every secret-looking parameter (``?password=``,
    ``sslpassword=``, ``token=``, ``secret=``, ...) replaced by ``***``. Also takes a
    libpq ``key=value`` string. Never raises."""
    if not isinstance(url, str):
        return f"<{type(url).__name__}>"
    text = url
    scheme, sep, rest = text.partition("://")
    if sep:
        userinfo, after = _userinfo(rest)
        user, colon, password = userinfo.partition(":")
        if colon and password:
            text = f"{scheme}://{user}:{MASK}@{after}"

    def mask(m: re.Match[str]) -> str:
        if not _secret_name(m.group(2)):
            inner = _nested_url(m.group(3))
            if inner is not None:  # ?listen_url=postgresql%3A%2F%2Fu%3Apw%40h...
                shown = redact(inner)
                if shown != inner:
                    return f"{m.group(1)}{m.group(2)}={quote(shown, safe='*')}"
            return m.group(0)
        return f"{m.group(1)}{m.group(2)}={MASK}"

    return _PARAM.sub(mask, text)


def _nested_url(value: str) -> str | None:
    """The URL a parameter's value holds, percent-encoded (``listen_url=``), or None."""
    decoded = unquote(value.strip("'"))
    return decoded if "://" in decoded else None


def secrets_in(url: str) -> list[str]:
    """The secret values of ``url`` (what :func:`redact` masks), as written and
    decoded, longest first: to scrub a message that quotes one of them."""
    if not isinstance(url, str):
        return []
    found: list[str] = []
    rest = url.partition("://")[2]
    userinfo = _userinfo(rest)[0]
    if ":" in userinfo:
        found.append(userinfo.partition(":")[2])
    nested: list[str] = []
    for m in _PARAM.finditer(url):
        if _secret_name(m.group(2)):
            found.append(m.group(3).strip("'"))
        else:
            inner = _nested_url(m.group(3))
            if inner is not None:
                nested += secrets_in(inner)
    found += [unquote(v) for v in found] + [unquote_plus(v) for v in found]
    # A URL inside a parameter: its secrets as they are and as they are written there.
    found += nested + [quote(v, safe="") for v in nested] + [quote(v) for v in nested]
    # Too short a value would mask unrelated text; such a password is no secret anyway.
    return sorted({v for v in found if len(v) >= 3 and v != MASK}, key=len, reverse=True)


def scrub(text: str, url: str) -> str:
    """``text`` with every secret of ``url`` masked, wherever and however quoted."""
    for secret in secrets_in(url):
        text = text.replace(secret, MASK)
        text = text.replace(repr(secret)[1:-1], MASK)
    return text


def _chained(exc: BaseException) -> list[BaseException]:
    """The exceptions a traceback of ``exc`` prints before it (causes and contexts)."""
    seen: list[BaseException] = []
    link = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    while link is not None and all(link is not s for s in seen):
        seen.append(link)
        link = link.__cause__ or (None if link.__suppress_context__ else link.__context__)
    return seen


def _scrubbed(exc: IdemlockError, url: str) -> IdemlockError | None:
    """A copy of ``exc`` whose message no longer holds a secret of ``url`` and whose
    chain holds none either (a chained exception that quotes one is dropped), or None
    if neither held one. The copy has the same type and attributes (errors pickle, so
    they copy)."""
    message = str(exc)
    clean = scrub(message, url)
    leaky = any(scrub(str(link), url) != str(link) for link in _chained(exc))
    if clean == message and not leaky:
        return None
    new = copy.copy(exc)
    new.args = (clean,)
    new.__cause__ = None if leaky else exc.__cause__
    new.__suppress_context__ = True
    return new
