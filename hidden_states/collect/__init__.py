"""The producer side of the hidden-states pass: features jobs out, shards in, check, export.

Imports producer/, shared/, hidden_states.store and .schema; never worker/ or capture/.
"""
