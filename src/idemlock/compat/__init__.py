"""Drop-in façades for APIs that idemlock covers under its own names.

* :mod:`idemlock.compat.fencekit`: fencekit's modules and classes, so
  ``from fencekit.lock import DistributedLock`` becomes
  ``from idemlock.compat.fencekit.lock import DistributedLock``.
* :mod:`idemlock.compat.ports`: the framework contract's idempotency port and
  lock command/query ports, over a ``Coordinator`` or ``AsyncCoordinator``.

Each is a mapping onto idemlock's ports: every claim, lease and fence decision is
made by idemlock's stores, never here. See docs/migrating-from-fencekit.md and
docs/framework-contract.md for the behaviours that differ.
"""
