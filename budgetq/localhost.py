"""Moved to simulator/local.py (so the library never imports the CLI package).

Kept only so that branches written before the move still import; import from
``simulator.local`` in new code. Delete once every branch has merged.
"""

from simulator.local import LocalRedis, LocalSim, cli_command, free_port, wait_http

__all__ = ["LocalRedis", "LocalSim", "cli_command", "free_port", "wait_http"]
