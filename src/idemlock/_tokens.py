"""Tokens: the attempt tokens that name one claim or lock owner (re-drawn after fork)
and the one check of a fencing token a caller hands back."""

from __future__ import annotations

import itertools
import os

from ._errors import ConfigurationError
from ._forks import at_fork


class _Tokens:
    """Unique, unguessable attempt tokens, cheaply: 64 random bits per process (drawn
    again after fork) and a counter."""

    def __init__(self) -> None:
        self.reseed()

    def reseed(self) -> None:
        # os.urandom is what secrets.token_hex reads; the secrets module costs more to
        # import than all of this module.
        self.prefix = os.urandom(8).hex()
        self.counter = itertools.count(1)

    def __call__(self) -> str:
        return f"{self.prefix}{next(self.counter):x}"


new_token = _Tokens()
at_fork(after_in_child=new_token.reseed)  # a child never draws its parent's tokens


#: Fencing tokens are ints in [0, MAX_TOKEN] (A4): what a signed 64-bit column holds,
#: so every store gives the same answer and none can overflow.
MAX_TOKEN = 2**63 - 1


def _int_repr(value: int) -> str:
    # repr() of an int of thousands of digits raises ValueError.
    return repr(value) if value.bit_length() <= 128 else f"an int of {value.bit_length()} bits"


def check_token(token: object) -> int:
    """The one check of a fencing token given to a gate: an int in [0, 2**63-1]."""
    if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= MAX_TOKEN:
        shown = repr(token) if not isinstance(token, int) else _int_repr(token)
        raise ConfigurationError(
            f"a fencing token is an int from 0 to 2**63-1 (lease.token or claim.fence), got {shown}"
        )
    return int(token)
