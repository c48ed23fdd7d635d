"""The worker side of the hidden-states pass: capture backends and the features worker.

Imports worker/, shared/ and hidden_states.schema; never producer/ or collect/.
"""
