"""Worker processes under a supervisor that kills them, and the killer.

Workers come from a fork server that has the drivers imported already, so a
replacement for a killed worker starts in milliseconds (spawn where there is none).
Each incarnation of a slot has its own name (``w<slot>.<n>``) and log file; ``kill``
is a SIGKILL (no cleanup, no goodbye: a crash or an OOM kill), ``stop`` a SIGSTOP
until ``wake_due`` sends SIGCONT (a stalled process: GC pause, swapped out, VM paused).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Slot:
    index: int
    incarnation: int = 0
    worker: str = ""
    proc: Any = None  # a multiprocessing Process
    log: Path | None = None
    stopped_until: float | None = None  # CLOCK_MONOTONIC; set while SIGSTOPped

    def tail(self, lines: int = 15) -> str:
        """The end of this incarnation's log, and how it exited."""
        text = self.log.read_text(errors="replace").strip() if self.log else ""
        code = self.proc.exitcode if self.proc is not None else None
        tail = "\n".join(text.splitlines()[-lines:])
        return f"worker {self.worker} exited with status {code}:\n{tail}"


def context(preload: list[str]) -> Any:
    """A fork server with ``preload`` imported, or spawn where there is none."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(preload)
    return ctx


def redirect(log: str, append: bool = False) -> None:
    """In a worker: stdout and stderr to its log file; SIGINT ignored (the supervisor
    ends its workers)."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
    fd = os.open(log, flags, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class Workers:
    """``count`` slots, each running ``target(config(slot), log_path)`` in a process."""

    def __init__(
        self,
        ctx: Any,
        target: Callable[[dict[str, Any], str], None],
        config: Callable[[Slot], dict[str, Any]],
        logs: Path,
        count: int,
        prefix: str = "",
    ) -> None:
        self.ctx, self.target, self.config, self.logs = ctx, target, config, logs
        self.prefix = prefix
        self.slots = [Slot(i + 1) for i in range(count)]

    def start(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        for slot in self.slots:
            self.spawn(slot)

    def spawn(self, slot: Slot) -> None:
        slot.incarnation += 1
        slot.worker = f"w{slot.index}.{slot.incarnation}"
        slot.log = self.logs / f"{self.prefix}{slot.worker}.log"
        slot.stopped_until = None
        args = (self.config(slot), str(slot.log))
        slot.proc = self.ctx.Process(target=self.target, args=args, daemon=True)
        slot.proc.start()

    def kill(self, slot: Slot) -> int | None:
        """SIGKILL and reap; the exit code (``-SIGKILL`` unless it had exited)."""
        slot.proc.kill()
        slot.proc.join()
        slot.stopped_until = None
        code: int | None = slot.proc.exitcode
        return code

    def kill_and_replace(self, slot: Slot, redeliver: Callable[[str], None]) -> int | None:
        """The killer: SIGKILL ``slot``'s worker, hand its jobs back to the queue as a
        broker does when the consumer's connection drops, start a replacement."""
        code = self.kill(slot)
        redeliver(slot.worker)
        self.spawn(slot)
        return code

    def stop(self, slot: Slot, seconds: float) -> None:
        os.kill(slot.proc.pid, signal.SIGSTOP)
        slot.stopped_until = time.monotonic() + seconds

    def wake_due(self, force: bool = False) -> None:
        now = time.monotonic()
        for slot in self.slots:
            if slot.stopped_until is not None and (force or now >= slot.stopped_until):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(slot.proc.pid, signal.SIGCONT)
                slot.stopped_until = None

    def live(self) -> list[Slot]:
        """Running (not stopped) live workers."""
        return [s for s in self.slots if s.stopped_until is None and s.proc.is_alive()]

    def close(self) -> None:
        """Wake and kill every worker still alive."""
        self.wake_due(force=True)
        for slot in self.slots:
            if slot.proc is not None and slot.proc.is_alive():
                self.kill(slot)
