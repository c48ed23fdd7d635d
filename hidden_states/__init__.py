"""The hidden-states pass (EAGLE-3 features) in one home, with its two sides and its store.

- ``schema``: the job payload and shard metadata both sides agree on;
- ``store/``: safetensors shards on disk, written atomically, indexed exactly once;
- ``collect/``: the producer side (enqueue features jobs, write shards, check, export);
- ``capture/``: the worker side (capture backends: http, transformers; the features worker).

``collect`` and ``capture`` never import each other, as producer/ and worker/ never do.
"""
