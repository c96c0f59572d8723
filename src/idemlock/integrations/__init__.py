"""Integrations of idemlock with frameworks.

Each integration is its own module (for example :mod:`idemlock.integrations.asgi`) and
imports its framework only when that module is imported, so ``import idemlock`` and
this package stay light.
"""
