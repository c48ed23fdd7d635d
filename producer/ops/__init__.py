"""What an operator runs beside a run: check, plan, export, the monitor page and /metrics.

Imports run/, reading/ and shared/; nothing imports it but the CLI.
"""
