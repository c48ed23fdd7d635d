"""SGLang's own request/response models, loaded from the installed ``sglang`` wheel (no GPU stack).

The wheel is installed with ``--no-deps`` (Makefile; version in tests/SGLANG_VERSION). Its
``sglang/__init__.py`` pulls in torch and the whole runtime, so this module registers an empty
``sglang`` package pointing at the wheel's directory and imports only the modules that carry
the HTTP contract: ``sglang.api.v1.api_types`` (the /generate JSON gate and response types),
``sglang.srt.entrypoints.openai.protocol`` (OpenAI models) and
``sglang.srt.sampling.sampling_params``. Two imports are stubbed, only while those modules load
and only if the real package is absent: ``torch`` (sampling_params -> watermarking/core.py uses
it in annotations and function bodies only) and ``IPython.display`` (sglang/utils.py imports
HTML/display at module level). The stubs are removed from sys.modules afterwards, so nothing
else in the test process sees a fake torch.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import sys
import types
from pathlib import Path
from typing import Any

VERSION_FILE = Path(__file__).with_name("SGLANG_VERSION")
WANTED_VERSION = VERSION_FILE.read_text().strip()
VOCAB_SIZE = 151_936   # any realistic vocabulary; verify() only uses it for logit_bias


class SGLangMissing(RuntimeError):
    pass


def _stub(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    return mod


def _load() -> types.SimpleNamespace:
    try:
        installed = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError as exc:
        raise SGLangMissing(f"sglang {WANTED_VERSION} is not installed: run `make test` (or `.venv/bin/pip install "
                            f"--no-deps sglang=={WANTED_VERSION}` and `.venv/bin/pip install -e '.[conformance]'`)"
                            ) from exc
    if installed != WANTED_VERSION:
        raise SGLangMissing(f"sglang {installed} is installed but tests/SGLANG_VERSION says {WANTED_VERSION}: "
                            f"`.venv/bin/pip install --no-deps sglang=={WANTED_VERSION}`")
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise SGLangMissing("sglang is installed but its package directory was not found")
    if "sglang" not in sys.modules or getattr(sys.modules["sglang"], "__file__", None):
        pkg = types.ModuleType("sglang")
        pkg.__path__ = list(spec.submodule_search_locations)   # skip sglang/__init__.py
        sys.modules["sglang"] = pkg
    stubs: dict[str, types.ModuleType] = {}
    if importlib.util.find_spec("torch") is None:
        stubs["torch"] = _stub("torch")
    if importlib.util.find_spec("IPython") is None:
        display = _stub("IPython.display", HTML=None, display=None)
        stubs["IPython"] = _stub("IPython", display=display)
        stubs["IPython.display"] = display
    sys.modules.update(stubs)
    try:
        api_types = importlib.import_module("sglang.api.v1.api_types")
        protocol = importlib.import_module("sglang.srt.entrypoints.openai.protocol")
        sampling = importlib.import_module("sglang.srt.sampling.sampling_params")
    finally:
        for name, mod in stubs.items():
            if sys.modules.get(name) is mod:
                del sys.modules[name]
    return types.SimpleNamespace(api_types=api_types, protocol=protocol, sampling=sampling, version=installed)


SGL = _load()

# The two name sets shared/sglang_names.py copies (test_sglang_conformance compares them).
SAMPLING_PARAMS_INIT_KEYS: frozenset[str] = frozenset(inspect.signature(SGL.sampling.SamplingParams).parameters)
CHAT_REQUEST_FIELDS: frozenset[str] = frozenset(SGL.protocol.ChatCompletionRequest.model_fields)
CONTRACT_SAMPLING_FIELDS: tuple[str, ...] = tuple(SGL.api_types._FIELDS_SamplingParams)


class _ByteTokenizer:
    """normalize() measures stop strings with a tokenizer; without one it refuses them."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode())


def sampling_params(params: dict) -> Any:
    """``SamplingParams(**params)``, normalised and verified, as tokenizer_manager does; raises as SGLang."""
    sp = SGL.sampling.SamplingParams(**params)
    sp.normalize(_ByteTokenizer())
    sp.verify(VOCAB_SIZE)
    return sp


def validate_generate_request(body: dict) -> None:
    """/generate: the JSON contract gate, then SamplingParams(**sampling_params).verify()."""
    SGL.api_types.GenerateRequest.from_json_value(body)
    sps = body.get("sampling_params") or {}
    for sp in sps if isinstance(sps, list) else [sps]:
        sampling_params(sp)


def validate_chat_request(body: dict, generation_config: dict | None = None) -> Any:
    """/v1/chat/completions: ChatCompletionRequest, its to_sampling_params, SamplingParams.verify()."""
    req = SGL.protocol.ChatCompletionRequest.model_validate(body)
    stop = req.stop if isinstance(req.stop, list) else ([req.stop] if req.stop else [])
    params = req.to_sampling_params(stop=stop, model_generation_config=generation_config or {})
    sampling_params(params)
    return req


def _diff(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}.{k}: only in the simulator" for k in a.keys() - b.keys()]
        out += [f"{path}.{k}: only in SGLang's model" for k in b.keys() - a.keys()]
        for k in a.keys() & b.keys():
            out += _diff(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: simulator {a!r} != SGLang {b!r}"]


def round_trip(model_name: str, data: dict) -> list[str]:
    """Parse ``data`` with SGLang's pydantic ``model_name`` and serialise it as SGLang would:
    the differences (keys SGLang would not send or would add, changed values); [] means exact."""
    model = getattr(SGL.protocol, model_name)
    dumped = model.model_validate(data).model_dump(mode="json")
    return _diff(data, dumped)
