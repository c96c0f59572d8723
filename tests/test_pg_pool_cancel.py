"""asyncio.run() must return when it ends while the async PostgreSQL store's pool is
still connecting in the background (psycopg_pool's workers swallow that cancellation;
the store's own pool must not)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from .servers._proc import popen
from .servers.postgres import PgServer
from .servers.proxy import TcpProxy

SCRIPT = textwrap.dedent(
    """
    import asyncio, sys, time
    import idemlock.aio
    from idemlock import LockSpec

    coord = idemlock.aio.connect(sys.argv[1])
    spec = LockSpec("pool-cancel", ttl=5)

    async def warm():
        lease = await coord.lock(spec).acquire("a")
        await coord.lock(spec).release(lease)

    asyncio.run(warm())
    print("warm", flush=True)
    sys.stdin.readline()  # the test silences the network now

    async def short():
        # Ends (cancelled) while a fresh pool for this loop is still connecting.
        try:
            await asyncio.wait_for(coord.lock(spec).acquire("b"), 0.3)
        except Exception as exc:
            print("raised", type(exc).__name__, flush=True)

    started = time.monotonic()
    asyncio.run(short())
    print("returned", round(time.monotonic() - started, 2), flush=True)
    """
)


@pytest.fixture
def proxy(postgres_server: PgServer) -> Iterator[TcpProxy]:
    with TcpProxy(postgres_server.port) as p:
        yield p


def test_asyncio_run_returns_while_the_pool_is_connecting(
    postgres_server: PgServer, proxy: TcpProxy
) -> None:
    url = postgres_server.dsn.replace(f":{postgres_server.port}/", f":{proxy.port}/")
    proc = popen(
        [sys.executable, "-c", SCRIPT, f"{url}?timeout=1"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=False,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "warm"
        proxy.blackhole()
        proc.stdin.write("\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"asyncio.run() hung while the pool was connecting:\n{out}\n{err[-2000:]}")
    assert proc.returncode == 0, err[-2000:]
    assert "raised TimeoutError" in out
    assert "returned" in out, out
