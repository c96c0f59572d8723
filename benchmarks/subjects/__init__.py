"""The subjects: each store's raw baseline, idemlock through its API (and its store
port alone), and each peer, as the functions the scenarios time.

One adapter per store (``memory``, ``sqlite``, ``redis`` for Redis and Redis Cluster,
``postgres``) builds a scenario's subjects on fresh clients: ``sync_fns(op, ...)`` and
``async_fns(op, tasks, ...)`` for the pairs, ``job_fns(...)`` for the crash-safe job,
``counting()`` for counting round trips; ``base`` has idemlock's own subjects, which
run on any store; ``peers`` the peers'; ``contenders.lock_pair`` gives one contender's
acquire/release for the contention scenario. Baselines: the raw driver doing the same
work in the same round trips (``common.BASELINES`` says which, for each store).
"""

from subjects.base import (
    RESULT_BYTES,
    aio_lock,
    ours_claim_pairs,
    ours_job,
    ours_job_together,
    ours_lock_pairs,
)
from subjects.contenders import lock_pair
from subjects.memory import MemoryBench
from subjects.peers import fencekit_job
from subjects.postgres import PgBench
from subjects.redis import RedisBench
from subjects.sqlite import SqliteBench

__all__ = [
    "RESULT_BYTES",
    "MemoryBench",
    "PgBench",
    "RedisBench",
    "SqliteBench",
    "aio_lock",
    "fencekit_job",
    "lock_pair",
    "ours_claim_pairs",
    "ours_job",
    "ours_job_together",
    "ours_lock_pairs",
]
