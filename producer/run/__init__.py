"""The run: the producer loop (enqueue with back-pressure, collect, finish), its budget loop,
disk guard, meta.json, id rules and the recovery of state from disk.

Imports reading/ and shared/ (and the hidden-states collector for ``capture: features``).
"""
