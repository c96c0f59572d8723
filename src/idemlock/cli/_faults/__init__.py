"""The fault harness shared by ``idemlock demo`` and ``benchmarks/chaos.py``.

* ``queue``: an at-least-once job queue in a database (one class over a SQLite or a
  PostgreSQL connection): a taken job turns invisible for a while and is delivered
  again when its worker dies, stalls or hands it back; ``consume``, a worker's job loop;
* ``workers``: worker processes started from a fork server, each logging to its own
  file, and the killer that SIGKILLs one, redelivers its jobs and starts a replacement.

Private: the demo and the benchmarks are its only users.
"""
