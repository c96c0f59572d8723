"""The pure domain of idemlock: no I/O, no drivers, no threads.

Key validation, canonical payload hashing, outcome values, lease arithmetic with an
injected clock, the store port (what a store must do, one atomic transition per
call) and the multi-step flows written once as generators for sync and async drivers.
"""
