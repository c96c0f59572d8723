"""A loopback TCP proxy for fault tests: forwards, goes silent, heals, cuts.

``TcpProxy(target_port)`` listens on a free loopback port and forwards every
connection to ``127.0.0.1:target_port``, both ways, from one selector thread.

* ``blackhole()`` stops forwarding in both directions **without closing** either
  side: bytes stay in the kernel buffers, nobody sees an error or an EOF. That is what
  a dead switch, a paused VM or a partition looks like to both ends (TCP keeps
  retransmitting into the void). New connections are accepted (the kernel completes
  the handshake of a listening socket anyway) and stay silent too.
* ``heal()`` forwards again; what was buffered is delivered late, as TCP would after
  a partition heals (so a request that timed out on the client may still be applied).
* ``cut()`` resets every connection through the proxy (both sides see a reset).
* ``silent()`` is a context manager: blackhole on entry, heal on exit.
* ``hold(pairs)`` silences some connections only (``open_pairs()`` lists them), as
  when one path through the network dies: the others and new ones keep working.

The proxy is a context manager; ``close()`` stops the thread (joined) and closes
every socket. Commands are applied by the proxy thread before they return, so once
``blackhole()`` returns not one more byte is forwarded.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["TcpProxy"]

#: bytes buffered per direction before the proxy stops reading from the sender
#: (back-pressure, as a full TCP window would)
BUFFER_LIMIT = 1 << 20
CHUNK = 1 << 16


class _Pair:
    """One proxied connection: the client side and the upstream side."""

    __slots__ = ("client", "closed", "eof", "last", "out", "shut", "upstream")

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client = client
        self.upstream = upstream
        # bytes waiting to be written to each socket
        self.out: dict[socket.socket, bytearray] = {client: bytearray(), upstream: bytearray()}
        # sockets whose peer sent EOF (nothing more to read from them)
        self.eof: set[socket.socket] = set()
        # sockets whose write side we shut down (their peer's EOF was passed on)
        self.shut: set[socket.socket] = set()
        self.closed = False
        self.last: socket.socket | None = None  # the side that sent the latest bytes

    def peer(self, sock: socket.socket) -> socket.socket:
        return self.upstream if sock is self.client else self.client


class TcpProxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(256)
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._listener, selectors.EVENT_READ, "accept")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._pairs: dict[socket.socket, _Pair] = {}
        self._forwarding = True
        self._held: set[_Pair] = set()  # connections silenced one by one (``hold``)
        self._running = True
        self._commands: list[tuple[Callable[[], Any], threading.Event, list[Any]]] = []
        self._commands_lock = threading.Lock()
        self.accepted = 0
        #: request/response turns: each time a client sends after the server answered
        self.turns = 0
        self._thread = threading.Thread(
            target=self._run, name=f"tcp-proxy-{self.port}", daemon=True
        )
        self._thread.start()

    # ---- public ------------------------------------------------------------------

    @property
    def forwarding(self) -> bool:
        return self._forwarding

    def blackhole(self) -> None:
        """Stop forwarding both ways; keep every connection open."""
        self._command(self._set_forwarding, False)

    def heal(self) -> None:
        """Forward again (buffered bytes are delivered now)."""
        self._command(self._set_forwarding, True)

    @contextlib.contextmanager
    def silent(self) -> Iterator[None]:
        self.blackhole()
        try:
            yield
        finally:
            self.heal()

    def cut(self) -> int:
        """Reset every connection through the proxy; returns how many there were."""
        result: int = self._command(self._cut_all)
        return result

    def open_pairs(self) -> list[object]:
        """The open connections, as handles for :meth:`hold`."""
        result: list[object] = self._command(lambda: list(self._unique_pairs()))
        return result

    def hold(self, pairs: list[object], held: bool = True) -> None:
        """Stop (``held``) or resume forwarding on these connections only."""
        self._command(self._hold, pairs, held)

    def connections(self) -> int:
        result: int = self._command(lambda: len({id(p) for p in self._pairs.values()}))
        return result

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        self._command(self._stop)
        self._thread.join(timeout=10)
        if self._thread.is_alive():  # pragma: no cover - would be a proxy bug
            raise RuntimeError(f"proxy thread on port {self.port} did not stop")

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- commands run on the proxy thread ----------------------------------------

    def _command(self, fn: Callable[..., Any], *args: Any) -> Any:
        if not self._thread.is_alive():
            raise RuntimeError(f"the proxy on port {self.port} is closed")
        done = threading.Event()
        box: list[Any] = []
        with self._commands_lock:
            self._commands.append((lambda: fn(*args), done, box))
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if not done.wait(10):  # pragma: no cover - would be a proxy bug
            raise RuntimeError(f"the proxy on port {self.port} did not answer a command")
        if box and isinstance(box[0], BaseException):
            raise box[0]
        return box[0] if box else None

    def _set_forwarding(self, on: bool) -> None:
        self._forwarding = on
        for pair in {id(p): p for p in self._pairs.values()}.values():
            self._update(pair)

    def _unique_pairs(self) -> list[_Pair]:
        return list({id(p): p for p in self._pairs.values()}.values())

    def _hold(self, pairs: list[_Pair], held: bool) -> None:
        for pair in pairs:
            (self._held.add if held else self._held.discard)(pair)
            self._update(pair)

    def _cut_all(self) -> int:
        pairs = list({id(p): p for p in self._pairs.values()}.values())
        for pair in pairs:
            self._close_pair(pair, reset=True)
        return len(pairs)

    def _stop(self) -> None:
        self._running = False

    # ---- the loop ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._running:
                for key, mask in self._sel.select(timeout=1.0):
                    if key.data == "accept":
                        self._accept()
                    elif key.data == "wake":
                        self._drain_commands()
                    else:
                        self._io(key.fileobj, mask)  # type: ignore[arg-type]
        finally:
            for pair in list({id(p): p for p in self._pairs.values()}.values()):
                self._close_pair(pair, reset=True)
            self._sel.close()
            self._listener.close()
            self._wake_r.close()
            self._wake_w.close()
            # Anyone still waiting for a command gets an answer.
            with self._commands_lock:
                for _, done, _box in self._commands:
                    done.set()
                self._commands.clear()

    def _drain_commands(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while self._wake_r.recv(4096):
                pass
        with self._commands_lock:
            commands, self._commands = self._commands, []
        for fn, done, box in commands:
            try:
                box.append(fn())
            except BaseException as exc:  # handed to the caller
                box.append(exc)
            done.set()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            self.accepted += 1
            upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            upstream.settimeout(2.0)
            try:
                upstream.connect(self.target)
            except OSError:
                # Server down: the client sees its connection reset, as a refused
                # connection through a live network would look.
                upstream.close()
                _reset(client)
                continue
            for s in (client, upstream):
                s.setblocking(False)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pair = _Pair(client, upstream)
            self._pairs[client] = pair
            self._pairs[upstream] = pair
            self._update(pair)

    def _io(self, sock: socket.socket, mask: int) -> None:
        pair = self._pairs.get(sock)
        if pair is None or pair.closed or not self._forwarding or pair in self._held:
            return
        peer = pair.peer(sock)
        try:
            if mask & selectors.EVENT_WRITE:
                buf = pair.out[sock]
                if buf:
                    sent = sock.send(buf)
                    del buf[:sent]
            if mask & selectors.EVENT_READ:
                data = sock.recv(CHUNK)
                if data:
                    pair.out[peer] += data
                    if sock is pair.client and pair.last is not sock:
                        self.turns += 1
                    pair.last = sock
                else:
                    pair.eof.add(sock)
            # Pass an EOF on once everything before it was delivered.
            for src in (pair.client, pair.upstream):
                dst = pair.peer(src)
                if src in pair.eof and not pair.out[dst] and dst not in pair.shut:
                    pair.shut.add(dst)
                    dst.shutdown(socket.SHUT_WR)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._close_pair(pair, reset=True)
            return
        if len(pair.shut) == 2:
            self._close_pair(pair, reset=False)
            return
        self._update(pair)

    def _update(self, pair: _Pair) -> None:
        """(Re)register each socket of a pair for what it may do now."""
        if pair.closed:
            return
        for sock in (pair.client, pair.upstream):
            events = 0
            if self._forwarding and pair not in self._held:
                peer = pair.peer(sock)
                if sock not in pair.eof and len(pair.out[peer]) < BUFFER_LIMIT:
                    events |= selectors.EVENT_READ
                if pair.out[sock]:
                    events |= selectors.EVENT_WRITE
            try:
                registered = self._sel.get_key(sock).events
            except KeyError:
                registered = 0
            if events == registered:
                continue
            if registered and events:
                self._sel.modify(sock, events, "io")
            elif events:
                self._sel.register(sock, events, "io")
            else:
                self._sel.unregister(sock)

    def _close_pair(self, pair: _Pair, *, reset: bool) -> None:
        if pair.closed:
            return
        pair.closed = True
        self._held.discard(pair)
        for sock in (pair.client, pair.upstream):
            self._pairs.pop(sock, None)
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(sock)
            if reset:
                _reset(sock)
            else:
                sock.close()


def _reset(sock: socket.socket) -> None:
    """Close with an RST instead of a FIN (SO_LINGER with a zero timeout)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
