"""The throwaway servers of tests/servers/ start on a busy machine."""

from __future__ import annotations

import socket

import pytest

from .servers import postgres


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
