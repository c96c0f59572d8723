"""The handler on the ``idemlock`` logger: warnings reach stderr when nothing else
would show them.

A library's ``NullHandler`` silences it completely when the application configured no
logging, and that is the usual case under servers: uvicorn's and gunicorn's default
setups configure their own loggers only, so a store that is down (answered 503) or a
lease that runs out under a running request would be logged nowhere. This handler
writes WARNING and above to ``sys.stderr`` (as :data:`logging.lastResort` would) only
while no other handler would receive the record: once the application configures a
handler anywhere on the way (the root logger, ``idemlock`` or one of its children),
it stays silent and the application's handlers decide.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["FallbackHandler"]


class FallbackHandler(logging.Handler):
    """WARNING and above to stderr while the record would otherwise reach no handler."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def _others(self, name: str) -> bool:
        logger: logging.Logger | None = logging.getLogger(name)
        while logger is not None:
            if any(h is not self for h in logger.handlers):
                return True
            if not logger.propagate:
                return False
            logger = logger.parent
        return False

    def handle(self, record: logging.LogRecord) -> bool:
        if record.levelno < self.level or self._others(record.name):
            return False
        return super().handle(record)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr  # looked up per record: tests and servers swap it
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)
