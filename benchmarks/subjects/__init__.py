"""The subjects: each store's raw baseline, idemlock through its API (and its store
port alone), and each peer, as the functions the scenarios time.

One adapter per store (``memory``, ``sqlite``, ``redis`` for Redis and Redis Cluster,
``postgres``) says how to open its store and what its raw baseline is; ``base.Adapter``
builds every scenario's subjects from that on fresh clients, with idemlock's own;
``peers`` has the peers'; ``contenders.lock_pair`` one contender's acquire/release.
Baselines: the raw driver doing the same work in the same round trips
(``common.BASELINES`` says which, for each store).
"""

from common import RESULT_BYTES

from subjects.base import (
    Adapter,
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
    "Adapter",
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
