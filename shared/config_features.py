"""The ``features:`` section of the config model: the hidden-states pass (docs/hidden_states.md)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from budgetq.shared.config_fields import Strict, TokenCount

# The folder, in a dataset's features directory, of the files the engine writes for generation requests.
ENGINE_DIR = "engine"


# ---------------------------------------------------------------------------------------------
# Hidden states: the `features` pass, a prefill-only request per committed row that
# returns the target model's hidden states (docs/hidden_states.md).
# ---------------------------------------------------------------------------------------------
class FeaturesServerConfig(Strict):
    # Servers started with --enable-return-hidden-states; None = the generation servers (server.urls).
    urls: list[str] | None = Field(default=None, min_length=1)
    # Servers started with --enable-return-aux-hidden-states --speculative-algorithm EAGLE3: each sample
    # is also prefilled there and the answer kept as its aux_hidden_state (what EAGLE-3 trains on).
    aux_urls: list[str] | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _check_urls(self) -> FeaturesServerConfig:
        for name in ("urls", "aux_urls"):
            urls = getattr(self, name)
            for url in urls or []:
                if not url.startswith(("http://", "https://")):
                    raise ValueError(f"features.server.{name}: {url!r} is not an http(s) URL")
            if urls:
                setattr(self, name, [u.rstrip("/") for u in urls])
        return self


class FeaturesModelConfig(Strict):
    """The target model the ``transformers`` capture backend loads into the features worker
    (hidden_states/capture/transformers_backend.py)."""

    # A local directory or a hub id (as AutoModel.from_pretrained takes it).
    path: str = Field(min_length=1)
    # The dtype the model runs in; None: features.dtype (bfloat16 for fp8).
    dtype: Literal["float16", "bfloat16", "float32"] | None = None
    # Where it runs: "cpu", "cuda", "cuda:1"...; or device_map ("auto" spreads a model over the GPUs).
    device: str = "cpu"
    device_map: str | None = None
    # transformers' attention implementation (sdpa, eager, flash_attention_2); None: transformers' default.
    attn_implementation: str | None = None
    # EAGLE-3's aux layers, as SpecForge numbers them (the output of decoder layer i); None: its default
    # [1, L // 2 - 1, L - 4], what SGLang captures too; [] captures the last layer only.
    aux_layers: list[Annotated[int, Field(ge=0)]] | None = None
    # A forward pass takes queued samples up to this many tokens (padding included); one longer runs alone.
    max_batch_tokens: int = Field(default=16384, gt=0)
    # How long a batch waits for more samples once one is there (the other jobs' requests are in flight).
    batch_wait_s: float = Field(default=0.01, ge=0)
    trust_remote_code: bool = False


class FeaturesVllmConfig(Strict):
    """The ``vllm`` capture backend (hidden_states/capture/vllm_backend.py): prefills on vLLM servers started
    with ``budgetq features --server-flags``, whose engine writes each sample's layers to a file in features.store."""

    # How long a worker waits for the engine to finish writing a file it has named (its .lock).
    file_wait_s: float = Field(default=600.0, gt=0)
    # One request for both: the generation requests of `capture: features` datasets ask the engine to write
    # their hidden states (prompt + answer) too, and the features job stores that file instead of sending a
    # second prefill (it falls back to one where the file is missing or its tokens differ). The generation
    # servers (server.urls) must then be started with `budgetq features --server-flags`.
    single_pass: bool = False


class FeaturesSyntheticConfig(Strict):
    """The ``synthetic`` capture backend (hidden_states/capture/synthetic_backend.py): made-up tensors at memory
    speed, no model. For tests and bench/features_store.py only."""

    hidden_size: int = Field(gt=0)
    aux_layers: int = Field(default=3, ge=0)   # EAGLE-3 stores 3 aux layers + the target
    max_tokens: int = Field(default=8192, gt=0)  # the longest sample it serves (its buffer)


class FeaturesConfig(Strict):
    server: FeaturesServerConfig = Field(default_factory=FeaturesServerConfig)
    # How features workers get hidden states: http (prefills on SGLang servers started with
    # --enable-return-hidden-states), transformers (the worker loads features.model and runs it itself) or
    # vllm (prefills on vLLM servers started with `budgetq features --server-flags`; needs features.store).
    # synthetic: made-up tensors, no model (tests and benchmarks only; needs features.synthetic).
    backend: Literal["http", "transformers", "vllm", "synthetic"] = "http"
    model: FeaturesModelConfig | None = None
    # A directory that the features workers and `budgetq features` (and, for backend vllm, the vLLM servers)
    # all see at this same path (NFS, Lustre, or one path on one box). Set: the workers write the shards
    # there themselves and Redis carries only index messages; None: the tensors travel through Redis
    # to the collector, which writes them under output_dir (workers need no shared volume).
    store: str | None = Field(default=None, min_length=1)
    vllm: FeaturesVllmConfig = Field(default_factory=FeaturesVllmConfig)
    synthetic: FeaturesSyntheticConfig | None = None
    # How hidden states are stored: float16, bfloat16 (the models' own dtype; no overflow), or fp8
    # (float8_e4m3fn, one float32 scale per token and layer: about half the bytes; docs/hidden_states.md).
    dtype: Literal["float16", "bfloat16", "fp8"] = "bfloat16"
    # A shard (out/<ds>/features/<n>.safetensors) is closed and written once it holds this much.
    shard_mb: float = Field(default=512.0, gt=0)
    # Admissions stop before the features of a run would pass this many bytes on disk (None: only
    # the volume's free space bounds it), with a clear message. Accepts 10G-style counts.
    max_bytes: TokenCount | None = None
    # Prefill requests in flight per features worker process.
    concurrency: int = Field(default=8, gt=0)
    # Response bytes (JSON in flight + decoded blobs) a features worker holds at once; it claims
    # no more while over (one request is always allowed).
    worker_max_mb: float = Field(default=2048.0, gt=0)
    # Decoded bytes waiting in Redis for the collector, per dataset; workers stop claiming over it.
    redis_max_mb: float = Field(default=2048.0, gt=0)
    # Processes decoding JSON responses per features worker (off the event loop).
    decode_processes: int = Field(default=2, gt=0)
    # Features jobs queued per dataset at once (each carries its token ids).
    high_water: int = Field(default=256, gt=0)

    @property
    def shard_bytes(self) -> int:
        return int(self.shard_mb * 2**20)

    @model_validator(mode="after")
    def _backend_has_a_model(self) -> FeaturesConfig:
        if self.backend == "transformers" and self.model is None:
            raise ValueError("features.backend transformers needs features.model.path (a local model directory "
                             "or a hub id)")
        if self.backend == "synthetic" and self.synthetic is None:
            raise ValueError("features.backend synthetic makes up its tensors (tests and benchmarks only): it needs "
                             "features.synthetic.hidden_size, set on purpose")
        if self.backend == "vllm" and (self.model is None or self.store is None):
            raise ValueError("features.backend vllm needs features.model.path (the served model's local directory: "
                             "its config.json gives the layers, its checkpoint the final norm) and features.store "
                             "(a directory the vLLM servers, the features workers and `budgetq features` all see)")
        if self.backend == "vllm" and not self.server.urls:
            raise ValueError("features.backend vllm needs features.server.urls: the vLLM servers started with "
                             "`budgetq features --server-flags` (such a server writes a file for every request it "
                             "serves, generation too, and vLLM's CPU build samples wrongly at temperature > 0 in "
                             "this mode: list the generation servers there only on purpose)")
        if self.vllm.single_pass and (self.backend != "vllm" or self.store is None):
            raise ValueError("features.vllm.single_pass needs features.backend vllm and features.store (the engine "
                             "writes each generation request's hidden states there)")
        return self

    def engine_dir(self, ds: str) -> str | None:
        """Where the engine writes the hidden states of a dataset's generation requests (single_pass), or None.
        In the dataset's features directory of the store (hidden_states/store/shards.py ``features_dir``), in a
        folder of its own: ``incoming/`` is emptied when a pass opens the store, and these files outlive that."""
        if not self.vllm.single_pass or self.store is None:
            return None
        return f"{self.store.rstrip('/')}/{ds}/features/{ENGINE_DIR}"
