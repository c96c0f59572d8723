"""Throwaway etcd servers for tests and benchmarks.

``start_etcd(n)`` starts an ``n``-member etcd cluster (1 or 3) on free loopback ports,
each member with its own data directory in a temporary folder, and waits until it
has a leader. ``EtcdCluster.kill(i)`` SIGKILLs a member, ``start_member(i)`` brings it
back on the same ports and data; ``leader()`` says which member leads. Members run
with a short heartbeat (20 ms) and election timeout (200 ms), so a failover takes
well under a second and etcd's smallest lease is 1 s.

``etcd_server`` (one member) and ``etcd_cluster`` (three) are session fixtures,
registered by importing them from ``tests/conftest.py``. A missing ``etcd`` binary
fails loudly (``apt-get install etcd-server``): a store test never skips.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ..contract.harness import Harness
from ._proc import mkdtemp, popen

__all__ = ["EtcdCluster", "etcd_cluster", "etcd_server", "find_etcd", "start_etcd"]

HEARTBEAT_MS = 20
ELECTION_MS = 200


def find_etcd() -> str:
    path = shutil.which("etcd")
    if not path:
        raise RuntimeError(
            "etcd was not found on PATH; the etcd store tests start their own throwaway "
            "members and need it: apt-get install etcd-server (these tests never skip)"
        )
    return path


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


class EtcdCluster:
    def __init__(self, root: Path, size: int, tls: tuple[Path, Path, Path] | None = None) -> None:
        self.root = root
        self.size = size
        #: (CA, server certificate, server key) for https client URLs, or None
        self.tls = tls
        self.scheme = "https" if tls else "http"
        ports = _free_ports(2 * size)
        self.client_ports = ports[:size]
        self.peer_ports = ports[size:]
        self.names = [f"m{i}" for i in range(size)]
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * size
        self.initial = ",".join(
            f"{n}=http://127.0.0.1:{p}" for n, p in zip(self.names, self.peer_ports, strict=True)
        )

    @property
    def endpoints(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.client_ports]

    @property
    def url(self) -> str:
        return "etcd://" + ",".join(self.endpoints)

    def start_member(self, i: int, state: str = "existing") -> None:
        etcd = find_etcd()
        data = self.root / self.names[i]
        cport, pport = self.client_ports[i], self.peer_ports[i]
        cmd = [
            etcd,
            "--name", self.names[i],
            "--data-dir", str(data),
            "--listen-client-urls", f"{self.scheme}://127.0.0.1:{cport}",
            "--advertise-client-urls", f"{self.scheme}://127.0.0.1:{cport}",
            "--listen-peer-urls", f"http://127.0.0.1:{pport}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{pport}",
            "--initial-cluster", self.initial,
            "--initial-cluster-state", state,
            "--initial-cluster-token", f"idemlock-{self.root.name}",
            "--heartbeat-interval", str(HEARTBEAT_MS),
            "--election-timeout", str(ELECTION_MS),
            "--logger", "zap",
            "--log-level", "error",
            "--log-outputs", str(self.root / f"{self.names[i]}.log"),
        ]  # fmt: skip
        if self.tls is not None:
            cmd += ["--cert-file", str(self.tls[1]), "--key-file", str(self.tls[2])]
        self.procs[i] = popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[i]
        if proc is None:
            return
        if sig == signal.SIGKILL:
            self.procs[i] = None
        os.kill(proc.pid, sig)
        if sig == signal.SIGKILL:
            proc.wait(timeout=10)

    def status(self, i: int, timeout: float = 1.0) -> object | None:
        import grpc

        from idemlock.stores.etcd._pb.etcdserverpb import rpc_pb2, rpc_pb2_grpc

        if self.tls is not None:
            creds = grpc.ssl_channel_credentials(root_certificates=self.tls[0].read_bytes())
            ch = grpc.secure_channel(self.endpoints[i], creds)
        else:
            ch = grpc.insecure_channel(self.endpoints[i])
        with ch:
            try:
                return rpc_pb2_grpc.MaintenanceStub(ch).Status(
                    rpc_pb2.StatusRequest(), timeout=timeout
                )
            except grpc.RpcError:
                return None

    def leader(self, timeout: float = 20.0) -> int:
        """The index of the member that leads (waiting for an election)."""
        deadline = time.monotonic() + timeout
        while True:
            for i in range(self.size):
                if self.procs[i] is None:
                    continue
                st = self.status(i)
                if st is not None and st.leader and st.leader == st.header.member_id:  # type: ignore[attr-defined]
                    return i
            if time.monotonic() > deadline:
                raise RuntimeError(f"the etcd cluster in {self.root} has no leader")
            time.sleep(0.02)

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        for i, proc in enumerate(self.procs):
            if proc is None:
                continue
            while self.status(i) is None:
                if proc.poll() is not None:
                    log = (self.root / f"{self.names[i]}.log").read_text(errors="replace")
                    raise RuntimeError(f"etcd member {self.names[i]} exited:\n{log[-3000:]}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"etcd member {self.names[i]} did not answer")
                time.sleep(0.02)
        self.leader(timeout)

    def start(self) -> None:
        for i in range(self.size):
            self.start_member(i, state="new")
        self.wait_ready()

    def stop(self) -> None:
        for i in range(self.size):
            with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
                proc = self.procs[i]
                if proc is not None:
                    os.kill(proc.pid, signal.SIGCONT)
                self.kill(i)

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def start_etcd(size: int = 1, tls: tuple[Path, Path, Path] | None = None) -> EtcdCluster:
    """Start an etcd cluster of ``size`` members (clients over TLS with ``tls`` = (CA,
    server certificate, server key) files); the caller must ``destroy()`` it."""
    for attempt in range(3):
        root = mkdtemp("idemlock-etcd-")
        cluster = EtcdCluster(root, size, tls)
        try:
            cluster.start()
            return cluster
        except RuntimeError as exc:
            cluster.destroy()
            # The free ports were taken before etcd bound them (other test runs on the
            # machine start servers too): again, on other ports.
            if "address already in use" not in str(exc).lower() or attempt == 2:
                raise
        except BaseException:
            cluster.destroy()
            raise
    raise AssertionError("unreachable")


def expire_due(url: str, now_ms: int | None = None, root: bytes | None = None) -> int:
    """Revoke the etcd lease of every idemlock key whose *requested* ttl or lease has
    passed; returns how many were revoked. ``root``: the store's ``?prefix=`` (default
    idemlock/).

    etcd counts leases in whole seconds (and checks them every 500 ms), so a 0.3 s
    lease lives about 1-1.5 s there. The contract suite's ``advance(seconds)`` means
    "let this much time pass for the store"; for etcd the harness does that by ending
    the leases that are due, the way a manual clock does for the memory store."""
    import grpc

    from idemlock.stores.etcd import _codec as K
    from idemlock.stores.etcd._pb.etcdserverpb import rpc_pb2, rpc_pb2_grpc

    now = K.now_ms() if now_ms is None else now_ms
    root = K.ROOT if root is None else root
    endpoint = url.split("://", 1)[1].split(",")[0]
    revoked = 0
    with grpc.insecure_channel(endpoint) as ch:
        kv, lease = rpc_pb2_grpc.KVStub(ch), rpc_pb2_grpc.LeaseStub(ch)
        resp = kv.Range(rpc_pb2.RangeRequest(key=root, range_end=K.prefix_end(root)), timeout=10)
        for item in resp.kvs:
            if not item.lease:
                continue
            try:
                kind = item.value[:1]
                if kind == b"L":
                    times = K.parse_lock(item.value).times
                elif kind == b"T":
                    times = K.parse_marker(item.value)
                elif kind == b"C":
                    val = K.parse_record(item.value)
                    assert isinstance(val, K.DoneVal)
                    times = val.times
                else:
                    continue
            except Exception:
                continue
            if times.expires_ms <= now:
                with contextlib.suppress(grpc.RpcError):
                    lease.LeaseRevoke(rpc_pb2.LeaseRevokeRequest(ID=item.lease), timeout=10)
                    revoked += 1
    return revoked


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdCluster]:
    """A one-member etcd shared by the session."""
    cluster = start_etcd(1)
    try:
        yield cluster
    finally:
        cluster.destroy()


@pytest.fixture(scope="session")
def etcd_cluster() -> Iterator[EtcdCluster]:
    """A three-member etcd cluster shared by the session. Do not kill members in a
    test; use ``start_etcd(3)`` for a cluster a test may break."""
    cluster = start_etcd(3)
    try:
        yield cluster
    finally:
        cluster.destroy()


def etcd_harness(name: str, url: str) -> Harness:
    """The contract suite's harness for an etcd store at ``url``: ``advance`` sleeps,
    then ends the leases that are due (see :func:`expire_due`)."""

    def open_sync(prefix: str, **options: Any) -> Any:
        import idemlock

        return idemlock.connect(url, key_prefix=prefix, **options)

    def open_async(prefix: str, **options: Any) -> Any:
        import idemlock.aio

        return idemlock.aio.connect(url, key_prefix=prefix, **options)

    class EtcdHarness(Harness):
        def advance(self, seconds: float) -> None:
            time.sleep(seconds)
            expire_due(url)

    return EtcdHarness(name, url, open_sync, open_async)


# ---- the fault contract's etcd (tests/contract/fault_stores.py) ---------------------------


class EtcdFaults:
    """Every member behind a per-test :class:`TcpProxy`: stall = blackhole every proxy
    (calls hang: no error, no reset); outage = SIGKILL every member, start them again
    on exit (same ports, same data: etcd keeps what it committed); restart = both."""

    def __init__(self, cluster: EtcdCluster) -> None:
        from .proxy import TcpProxy

        self.cluster = cluster
        self.proxies = [TcpProxy(p) for p in cluster.client_ports]

    @property
    def url(self) -> str:
        return "etcd://" + ",".join(f"127.0.0.1:{p.port}" for p in self.proxies)

    def _heal(self) -> None:
        for p in self.proxies:
            p.heal()

    @contextlib.contextmanager
    def stall(self) -> Iterator[None]:
        from .faults import _safety

        for p in self.proxies:
            p.blackhole()
        with _safety(self._heal):
            yield

    def _stop(self) -> None:
        for i in range(self.cluster.size):
            self.cluster.kill(i)

    def _start(self) -> None:
        for i in range(self.cluster.size):
            self.cluster.start_member(i)
        self.cluster.wait_ready()

    @contextlib.contextmanager
    def outage(self) -> Iterator[None]:
        self._stop()
        try:
            yield
        finally:
            self._start()

    def restart(self) -> None:
        self._stop()
        self._start()

    def close(self) -> None:
        for p in self.proxies:
            p.close()
        if any(proc is None for proc in self.cluster.procs):
            self._start()  # leave the session's cluster up for the next test


def etcd_fault_harness(name: str, cluster: EtcdCluster) -> Harness:
    """A contract harness whose URL goes through the proxies of an :class:`EtcdFaults`
    (``harness.faults``)."""
    faults = EtcdFaults(cluster)
    harness = etcd_harness(name, faults.url)
    harness.faults = faults
    return harness


@pytest.fixture(scope="session")
def fault_etcd_server() -> Iterator[EtcdCluster]:
    """A one-member etcd that fault tests may stall, kill and restart."""
    cluster = start_etcd(1)
    try:
        yield cluster
    finally:
        cluster.destroy()


@pytest.fixture(scope="session")
def fault_etcd_cluster() -> Iterator[EtcdCluster]:
    """A three-member etcd cluster that fault tests may stall, kill and restart."""
    cluster = start_etcd(3)
    try:
        yield cluster
    finally:
        cluster.destroy()
