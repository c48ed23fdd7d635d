"""Which kind of server an endpoint is, and which model name the requests to it carry.

The worker asks each endpoint once (worker/endpoints.py) and ``budgetq check`` asks the same way
(worker/sglang_client.py ``probe_server``): SGLang answers ``/server_info`` with its server args;
vLLM has no ``/server_info`` (404) and lists its models on ``/v1/models`` with ``owned_by: "vllm"``
(vllm/entrypoints/serve/engine/protocol.py ``ModelCard``); anything else is another OpenAI-style
server (llama.cpp's, a gateway).

The model name: SGLang serves one model under any name, so without ``server.model`` it gets
``default`` as it always did. vLLM answers any other name with a 404 (``The model 'default' does
not exist``), so an endpoint that is not SGLang gets the one id its ``/v1/models`` lists; with
several ids there is no right guess and the run stops at once, naming ``server.model``.
"""

from __future__ import annotations

from budgetq.shared.errors import ConfigError

SGLANG, VLLM, OPENAI = "sglang", "vllm", "openai"
KINDS = (SGLANG, VLLM, OPENAI)
LABELS = {SGLANG: "SGLang", VLLM: "vLLM", OPENAI: "OpenAI-style"}
SGLANG_MODEL = "default"    # SGLang's model name when server.model is not set: any name is accepted


def kind_of_models(body: object) -> tuple[str, list[str]]:
    """(kind, model ids) of a server that is not SGLang, from its ``/v1/models`` answer (None if it has none)."""
    data = body.get("data") if isinstance(body, dict) else None
    cards = [m for m in data if isinstance(m, dict) and m.get("id")] if isinstance(data, list) else []
    kind = VLLM if any(m.get("owned_by") == "vllm" for m in cards) else OPENAI
    return kind, [str(m["id"]) for m in cards]


def several_models(url: str, ids: list[str]) -> str:
    """The one line of a server that serves several models while server.model is not set."""
    return (f"server {url} serves {len(ids)} models ({', '.join(ids)}) and server.model is not set: "
            f"set server.model to the one to use")


def resolve_model(configured: str | None, kind: str, ids: list[str], url: str) -> str:
    """The model name requests to this endpoint carry (module docstring); ConfigError for several ids."""
    if configured is not None:
        return configured
    if kind == SGLANG or not ids:       # no /v1/models to read: as before
        return SGLANG_MODEL
    if len(ids) > 1:
        raise ConfigError(several_models(url, ids))
    return ids[0]
