"""A throwaway Redis Sentinel group for tests: a primary, a replica and three Sentinels.

``start_sentinel_group(root)`` runs a primary and a replica (``redis-server
--replicaof``, no persistence) and three ``redis-server --sentinel`` processes on free
loopback ports, all through ``_proc.popen`` so they die with the test process. The
Sentinels monitor the primary as ``SERVICE`` with a quorum of 2 and fast settings
(``down-after-milliseconds 500``, ``failover-timeout 2000``); the start returns once
the replica is in sync and every Sentinel knows the replica and the two other
Sentinels (else a failover could not get its quorum).

``group.kill_primary()`` SIGKILLs the primary; ``group.wait_failover(old_port)`` polls
the Sentinels until they name another primary and it answers as a primary;
``group.rejoin(old_port)`` starts the old one again as the new primary's replica.
Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._proc import popen
from .redis import RedisServer, find_redis, free_port

__all__ = ["SERVICE", "SentinelGroup", "start_sentinel_group"]

SERVICE = "ilsvc"
DOWN_AFTER_MS = 500
FAILOVER_TIMEOUT_MS = 2000
FAST = ("--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0")


def _wait(what: str, check: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(Exception):
            if check():
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.02)


class Sentinel:
    """One ``redis-server --sentinel`` process (its config file must be writable)."""

    def __init__(self, root: Path, port: int, primary_port: int) -> None:
        self.root = root
        self.port = port
        self.primary_port = primary_port
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        server, _ = find_redis()
        self.root.mkdir(parents=True, exist_ok=True)
        conf = self.root / "sentinel.conf"
        conf.write_text(
            f"port {self.port}\n"
            "bind 127.0.0.1\n"
            f"dir {self.root}\n"
            f"logfile {self.root / 'sentinel.log'}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {self.primary_port} 2\n"
            f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {SERVICE} {FAILOVER_TIMEOUT_MS}\n"
            f"sentinel parallel-syncs {SERVICE} 1\n"
        )
        self.proc = popen(
            [server, str(conf), "--sentinel"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def client(self) -> Any:
        import redis

        return redis.Redis(port=self.port, socket_timeout=1, decode_responses=True)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            proc.kill()
            proc.wait(timeout=10)


class SentinelGroup:
    def __init__(self, primary: RedisServer, replica: RedisServer, sentinels: list[Sentinel]):
        self.servers = {primary.port: primary, replica.port: replica}
        self.primary_port = primary.port
        self.sentinels = sentinels

    def url(self, query: str = "", db: int | None = None) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        path = f"/{SERVICE}" + (f"/{db}" if db is not None else "")
        return f"redis+sentinel://{hosts}{path}" + (f"?{query}" if query else "")

    @property
    def primary(self) -> RedisServer:
        return self.servers[self.primary_port]

    @property
    def replica(self) -> RedisServer:
        (port,) = [p for p in self.servers if p != self.primary_port]
        return self.servers[port]

    def named_primary(self) -> int | None:
        """The primary's port as the first Sentinel that answers names it."""
        for s in self.sentinels:
            with contextlib.suppress(Exception), s.client() as r:
                addr = r.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
                if addr:
                    return int(addr[1])
        return None

    def kill_primary(self) -> int:
        """SIGKILL the primary; returns its port."""
        old = self.primary_port
        proc = self.primary.proc
        assert proc is not None
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        self.primary.proc = None
        return old

    def pause_replica(self) -> None:
        """SIGSTOP the replica and cut its link (the primary closes it): writes the
        primary acknowledges from now on are not replicated, not even into the
        replica's socket buffer, until it reconnects after ``resume_replica``."""
        import redis

        proc = self.replica.proc
        assert proc is not None
        proc.send_signal(signal.SIGSTOP)
        with redis.Redis(port=self.primary_port, socket_timeout=5) as r:
            r.execute_command("CLIENT", "KILL", "TYPE", "replica")
            _wait(
                "the primary to drop its replica",
                lambda: r.info("replication")["connected_slaves"] == 0,
                10,
            )

    def resume_replica(self) -> None:
        proc = self.replica.proc
        assert proc is not None
        proc.send_signal(signal.SIGCONT)

    def wait_failover(self, old_port: int, timeout: float = 30.0) -> int:
        """Wait until the Sentinels name a primary other than ``old_port`` and it says
        it is one; returns its port."""
        import redis

        def promoted() -> bool:
            # Every Sentinel names the same new primary (a lagging one acting on the old
            # configuration could otherwise still reconfigure a server behind the test).
            named = set()
            for s in self.sentinels:
                with s.client() as r:
                    addr = r.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
                named.add(int(addr[1]) if addr else None)
            (port,) = named if len(named) == 1 else (None,)
            if port is None or port == old_port:
                return False
            with redis.Redis(port=port, socket_timeout=1) as r:
                if r.info("replication")["role"] != "master":
                    return False
            self.primary_port = port
            return True

        _wait("a Sentinel failover", promoted, timeout)
        return self.primary_port

    def wait_demoted(self, port: int, timeout: float = 30.0) -> None:
        """Wait until the server on ``port`` says it is a replica."""
        import redis

        def demoted() -> bool:
            with redis.Redis(port=port, socket_timeout=1) as r:
                return bool(r.info("replication")["role"] == "slave")

        _wait(f"the server on port {port} to be demoted", demoted, timeout)

    def rejoin(self, old_port: int, promotable: bool = True) -> None:
        """Start the killed primary again as a replica of the new one (empty: it had
        no persistence), and wait until it is in sync. ``promotable=False``: with
        replica-priority 0, never promoted (a test that wants no later failover: one
        the Sentinels might start on their own, pings being late on a busy machine,
        must not make the rejoined server the primary while it syncs)."""
        server = self.servers[old_port]
        priority = () if promotable else ("--replica-priority", "0")
        server.extra = (*FAST, "--replicaof", "127.0.0.1", str(self.primary_port), *priority)
        server.start()
        self.wait_in_sync()

    def wait_in_sync(self, timeout: float = 30.0) -> None:
        """Wait until the replica's link to the primary is up and it has caught up."""
        import redis

        def synced() -> bool:
            # The Sentinels may have failed over on their own meanwhile (pings late on a
            # busy machine): the roles are the ones they name now.
            self.follow_named_primary()
            with redis.Redis(port=self.replica.port, socket_timeout=1) as r:
                info = r.info("replication")
            with redis.Redis(port=self.primary.port, socket_timeout=1) as p:
                offset = p.info("replication")["master_repl_offset"]
                in_sync = bool(
                    info.get("master_link_status") == "up"
                    and info.get("slave_repl_offset", -1) >= offset
                )
                # ... and the primary counts it: what durability=replicas:1 waits for
                return in_sync and int(p.execute_command("WAIT", 1, 500)) >= 1

        try:
            _wait("the replica to be in sync", synced, timeout)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}; {self.describe()}") from None

    def follow_named_primary(self) -> None:
        """Take the server the Sentinels name as the primary, once it says it is one."""
        import redis

        named = self.named_primary()
        if named is None or named == self.primary_port or named not in self.servers:
            return
        with redis.Redis(port=named, socket_timeout=1) as r:
            if r.info("replication")["role"] == "master":
                self.primary_port = named

    def describe(self) -> str:
        """Each server's replication state, and the failovers logged (for an error)."""
        import redis

        states = []
        for port in self.servers:
            try:
                with redis.Redis(port=port, socket_timeout=1) as r:
                    info = r.info("replication")
                keys = ("role", "master_link_status", "master_repl_offset", "slave_repl_offset")
                states.append(f"{port}: { ({k: info[k] for k in keys if k in info}) }")
            except Exception as exc:
                states.append(f"{port}: {type(exc).__name__}: {exc}")
        return (
            f"primary taken as {self.primary_port}, named {self.named_primary()}; "
            f"{'; '.join(states)}; failovers logged: {len(self.switches())}"
        )

    def switches(self) -> list[str]:
        """The failovers the first Sentinel logged ("+switch-master" lines): one per
        failover a test caused, more if the Sentinels failed over on their own."""
        log = self.sentinels[0].root / "sentinel.log"
        with contextlib.suppress(OSError):
            return [line for line in log.read_text().splitlines() if "+switch-master" in line]
        return []

    def stop(self) -> None:
        for s in self.sentinels:
            with contextlib.suppress(Exception):
                s.stop()
        for server in self.servers.values():
            with contextlib.suppress(Exception):
                if server.proc is not None:
                    server.proc.send_signal(signal.SIGCONT)
                server.stop()


def start_sentinel_group(root: Path) -> SentinelGroup:
    """A primary, its replica and three Sentinels, ready for a failover."""
    primary = RedisServer(root / "primary", free_port(), FAST)
    sentinels: list[Sentinel] = []
    group: SentinelGroup | None = None
    try:
        primary.start()
        replica = RedisServer(
            root / "replica", free_port(), (*FAST, "--replicaof", "127.0.0.1", str(primary.port))
        )
        group = SentinelGroup(primary, replica, sentinels)
        replica.start()
        group.wait_in_sync()
        for i in range(3):
            s = Sentinel(root / f"sentinel{i}", free_port(), primary.port)
            sentinels.append(s)
            s.start()

        def ready() -> bool:
            for s in sentinels:
                with s.client() as r:
                    state = r.execute_command("SENTINEL", "MASTER", SERVICE)
                    if isinstance(state, list):
                        state = dict(zip(state[::2], state[1::2], strict=False))
                    if int(state["num-slaves"]) < 1 or int(state["num-other-sentinels"]) < 2:
                        return False
            return True

        _wait("the Sentinels to know the replica and each other", ready, 60)
        return group
    except BaseException:
        if group is not None:
            group.stop()
        else:
            primary.stop()
        raise
