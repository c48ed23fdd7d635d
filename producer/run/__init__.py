"""The run: the producer loop (enqueue with back-pressure, collect, finish), its budget loop,
disk guard, meta.json, id rules and the recovery of state from disk.

Imports reading/ and shared/ only; ``capture: features`` reaches it through a hook (hooks.py) that the CLI
registers, so hidden_states/ imports the producer and never the other way.
"""
