"""The subjects: each store's raw baseline, idemlock through its API (and its store
port alone), and each peer, as the functions the scenarios time. One adapter per store
(``memory``, ``sqlite``, ``redis`` for Redis and Redis Cluster, ``postgres``: how to
open it, its raw requests, its contender) on ``base.Adapter``; the peers' in ``peers``.
"""
