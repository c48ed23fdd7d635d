"""Feature shards on disk: the safetensors format, atomic writes, the index.

Imports only shared/ and hidden_states.schema.
"""
