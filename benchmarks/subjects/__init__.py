"""The subjects: each store's raw baseline, idemlock through its API (and its store
port alone), and each peer, as the functions the scenarios time.

One adapter per store (``memory``, ``sqlite``, ``redis`` for Redis and Redis Cluster,
``postgres``) says how to open its store and what its raw baseline is
(``common.BASELINES`` says which); ``base.Adapter`` builds every scenario's subjects
from that with idemlock's own; ``peers`` has the peers'; ``contenders.lock_pair`` one
contender's acquire/release.
"""
