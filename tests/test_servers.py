"""The throwaway servers of tests/servers/ start on a busy machine."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from .servers import etcd, postgres, redis


@contextlib.contextmanager
def _taken_port() -> Iterator[int]:
    """A loopback port in use: what another test run on the machine does between our
    probe for a free port and our server's bind."""
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


def test_postgres_moves_to_another_port_when_its_free_port_was_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with socket.socket() as taken:
        # What another test run on the machine does between our probe and our bind.
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        ports = iter([busy])
        real = postgres._free_port
        monkeypatch.setattr(postgres, "_free_port", lambda: next(ports, None) or real())
        server = postgres.start_postgres()
        try:
            assert server.port != busy
            assert server.proc is not None and server.proc.poll() is None
            assert f":{server.port}/" in server.dsn
        finally:
            server.destroy()


def test_redis_moves_to_another_port_when_its_free_port_was_taken(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with _taken_port() as busy:
        ports = iter([busy])
        real = redis.free_port
        monkeypatch.setattr(redis, "free_port", lambda **kw: next(ports, None) or real(**kw))
        server = redis.start_redis(tmp_path)
        try:
            assert server.port != busy
            assert server.proc is not None and server.proc.poll() is None
        finally:
            server.stop()


def test_etcd_moves_to_other_ports_when_its_free_ports_were_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with _taken_port() as busy:
        calls = iter([[busy, *etcd._free_ports(1)]])
        real = etcd._free_ports
        monkeypatch.setattr(etcd, "_free_ports", lambda n: next(calls, None) or real(n))
        cluster = etcd.start_etcd(1)
        try:
            assert cluster.client_ports[0] != busy
            assert cluster.status(0) is not None
        finally:
            cluster.destroy()
