"""What a vLLM server started for hidden states writes, and how budgetq reads it back (no torch, no vLLM).

vLLM (0.32) has no HTTP field for hidden states. A server started with a speculative method,
``extract_hidden_states``, and a KV connector, ``ExampleHiddenStatesConnector``, writes for each request a
safetensors file: ``hidden_states [tokens, n_layers, hidden]`` (the served dtype) and ``token_ids [tokens]``,
to the path the request names in ``kv_transfer_params.hidden_states_path``
(vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py).

Layer ids. vLLM's id k is the residual stream at the *input* of decoder layer k (``hidden_states + residual``,
vllm/model_executor/models/interfaces.py ``EagleModelMixin._maybe_add_hidden_state``, called by
models/llama.py ``LlamaModel.forward`` before layer ``start_layer`` and after each layer ``idx`` with
``idx + 1``), i.e. transformers' ``output_hidden_states[k]``. The ids are sorted and made distinct
(``_set_aux_hidden_state_layers``: ``tuple(sorted(set(layers)))``): the file's layer axis is in that order.

- EAGLE-3's aux layers, the output of decoder layers ``[1, L // 2 - 1, L - 4]`` as SpecForge numbers them
  (features.model.aux_layers), are vLLM ids ``a + 1``: ``[2, L // 2, L - 3]``, vLLM's own EAGLE-3 default
  (``get_eagle3_default_aux_hidden_state_layers``).
- The target, SpecForge's and SGLang's ``hidden_state``, is the output of the final norm. vLLM's largest id,
  ``L``, is the last layer *before* that norm (``LlamaModel.forward`` applies ``self.norm`` after collecting
  it), so the worker applies the model's final norm itself: its weight (and bias) from the checkpoint, its
  epsilon from config.json, in float32 (``FinalNorm``). Which norm is config.json's to say: RMSNorm where it
  gives ``rms_norm_eps`` (Llama, Qwen, Mistral...), LayerNorm where it gives only ``layer_norm_eps`` (or
  ``layer_norm_epsilon``: StableLM, Cohere, GPT-NeoX...), a ConfigError where it gives neither.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from budgetq.hidden_states.store.safetensors_io import ShardError, read_header, read_tensor
from budgetq.shared.errors import ConfigError

CONNECTOR = "ExampleHiddenStatesConnector"
# Where the engine writes a request that names no file (a request not sent by a features worker).
DEFAULT_SUBDIR = "vllm-default"
# The final norm's weight, as checkpoints name it (Llama, Qwen, Mistral...; a multimodal wrapper's text model).
NORM_KEYS = ("model.norm.weight", "model.language_model.norm.weight", "language_model.model.norm.weight",
             "norm.weight")
# Their final norm is neither RMSNorm nor LayerNorm with the checkpoint's weight (Gemma's is x / rms(x) * (1 + w)):
# refused rather than stored wrong.
OTHER_NORMS = ("gemma",)


def text_config(model_dir: Path) -> dict:
    """config.json (its ``text_config`` for a multimodal model), or ConfigError naming the file."""
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"features.model.path: cannot read {path}: {exc}") from None
    return cfg.get("text_config") or cfg


@dataclass(frozen=True)
class VllmLayout:
    """Which layers a server is asked for, and where each sits on the file's layer axis."""

    num_layers: int
    hidden: int
    aux: list[int]          # SpecForge numbering (output of decoder layer a)

    @property
    def target_id(self) -> int:
        return self.num_layers

    @property
    def aux_ids(self) -> list[int]:
        return [a + 1 for a in self.aux]

    @property
    def layer_ids(self) -> list[int]:
        """What the server's speculative config lists (and, in this order, what its files hold)."""
        return sorted({*self.aux_ids, self.target_id})

    def position(self, layer_id: int) -> int:
        return self.layer_ids.index(layer_id)


def layout_for(model_dir: Path, aux_layers: list[int] | None) -> VllmLayout:
    cfg = text_config(model_dir)
    try:
        n, hidden = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
    except (KeyError, TypeError, ValueError):
        raise ConfigError(f"{model_dir}/config.json has no num_hidden_layers / hidden_size") from None
    aux = [1, n // 2 - 1, n - 4] if aux_layers is None else list(aux_layers)
    bad = [a for a in aux if not 0 <= a < n]
    if bad or len(set(aux)) != len(aux):
        raise ConfigError(f"features.model.aux_layers {aux}: each must be a distinct decoder layer in [0, {n - 1}] "
                          f"(the model has {n} layers)")
    return VllmLayout(n, hidden, aux)


def server_flags(model_dir: Path, aux_layers: list[int] | None, store: str, connector: str = CONNECTOR,
                 module_path: str | None = None) -> list[str]:
    """The ``vllm serve`` flags that make the engine write these layers for every request (``module_path``: a
    connector class of one's own, as the CPU tests load one)."""
    layout = layout_for(model_dir, aux_layers)
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layout.layer_ids}}}
    kv: dict = {"kv_connector": connector, "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": str(Path(store) / DEFAULT_SUBDIR),
                                              "allow_custom_save_path": True}}
    if module_path:
        kv["kv_connector_module_path"] = module_path
    return ["--speculative-config", json.dumps(spec, separators=(",", ":")),
            "--kv-transfer-config", json.dumps(kv, separators=(",", ":"))]


def flags_line(flags: list[str]) -> str:
    return shlex.join(flags)


class FinalNorm:
    """The model's final norm in float32: RMSNorm ``x / sqrt(mean(x^2) + eps) * w`` or, with ``layer=True``,
    LayerNorm ``(x - mean(x)) / sqrt(var(x) + eps) * w (+ b)``; its weight (and bias) from the checkpoint."""

    def __init__(self, weight: np.ndarray, eps: float, layer: bool = False, bias: np.ndarray | None = None) -> None:
        self.weight = weight.astype(np.float32)
        self.eps = float(eps)
        self.layer = layer
        self.bias = None if bias is None else bias.astype(np.float32)

    @property
    def kind(self) -> str:
        return "LayerNorm" if self.layer else "RMSNorm"

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float32, copy=False)
        if self.layer:
            x = x - np.mean(x, axis=-1, keepdims=True)
        var = np.mean(np.square(x, dtype=np.float32), axis=-1, keepdims=True)
        out = (x / np.sqrt(var + np.float32(self.eps))).astype(np.float32) * self.weight
        return out if self.bias is None else out + self.bias


def norm_kind(cfg: dict, where: Path) -> tuple[bool, float]:
    """(LayerNorm?, epsilon) of a model's final norm, as its config.json says: ``rms_norm_eps`` is RMSNorm's,
    ``layer_norm_eps`` / ``layer_norm_epsilon`` (and no ``rms_norm_eps``) LayerNorm's (transformers' names)."""
    if cfg.get("rms_norm_eps") is not None:
        return False, float(cfg["rms_norm_eps"])
    for key in ("layer_norm_eps", "layer_norm_epsilon"):
        if cfg.get(key) is not None:
            return True, float(cfg[key])
    raise ConfigError(f"{where}/config.json has no rms_norm_eps or layer_norm_eps: the final norm cannot be "
                      "applied")


def _as_f32(dtype: str, data: bytes | memoryview) -> np.ndarray:
    if dtype == "F32":
        return np.frombuffer(data, "<f4")
    if dtype == "F16":
        return np.frombuffer(data, "<f2").astype(np.float32)
    if dtype == "BF16":
        return (np.frombuffer(data, "<u2").astype(np.uint32) << np.uint32(16)).view("<f4")
    raise ShardError(f"dtype {dtype} is not a float type this reader knows")


def as_f32(dtype: str, data: bytes | memoryview, shape: list[int]) -> np.ndarray:
    """A safetensors float tensor's bytes as a float32 array of ``shape``."""
    return _as_f32(dtype, data).reshape(shape)


def load_final_norm(model_dir: Path, hidden: int) -> FinalNorm:
    """The final norm of the checkpoint in ``model_dir`` (safetensors, sharded or not)."""
    d = Path(model_dir)
    cfg = text_config(d)
    kind = str(cfg.get("model_type", ""))
    if kind.startswith(OTHER_NORMS):
        raise ConfigError(f"features.backend vllm: {kind}'s final norm is not x / rms(x) * w nor a LayerNorm; this "
                          "backend applies only those to vLLM's last layer (use features.backend transformers)")
    layer, eps = norm_kind(cfg, d)
    files: dict[str, Path] = {}
    wanted = {*NORM_KEYS, *(k.removesuffix("weight") + "bias" for k in NORM_KEYS)}
    index = d / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = {k: d / v for k, v in weight_map.items() if k in wanted}
    else:
        for f in sorted(d.glob("*.safetensors")):
            header, _ = read_header(f)
            files.update({k: f for k in wanted if k in header and k not in files})
    key = next((k for k in NORM_KEYS if k in files), None)
    if key is None:
        raise ConfigError(f"features.model.path {d}: no final norm weight ({', '.join(NORM_KEYS)}) in its "
                          "safetensors files")
    weight = _vector(files[key], key, hidden)
    bias_key = key.removesuffix("weight") + "bias"
    bias = _vector(files[bias_key], bias_key, hidden) if bias_key in files else None
    if bias is not None and not layer:
        raise ConfigError(f"{files[bias_key]}: {bias_key}: an RMSNorm (config.json's rms_norm_eps) has no bias")
    return FinalNorm(weight, eps, layer, bias)


def _vector(path: Path, key: str, hidden: int) -> np.ndarray:
    t = read_tensor(path, key)
    if t.shape != [hidden]:
        raise ConfigError(f"{path}: {key} has shape {t.shape}, expected [{hidden}]")
    try:
        return as_f32(t.dtype, t.data, t.shape)
    except ShardError as exc:
        raise ConfigError(f"{path}: {key}: {exc}") from None
