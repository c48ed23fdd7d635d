"""Hidden states on /generate, as SGLang 0.5.23 returns them (``return_hidden_states``).

What SGLang does, and where (sglang/srt in the pinned wheel):
- The server's ceiling: ``--return-hidden-states-mode {last,full}`` or the legacy
  ``--enable-return-hidden-states`` (= full) (arg_groups/fields/exec_.py;
  model_executor/forward_batch_info.py ``get_server_return_hidden_states_mode``).
- A request's mode over HTTP: ``true`` = full, ``false`` (or null) = none, or a list of those,
  one per input of a batch. The /generate JSON contract gate (entrypoints/api_contract.py,
  api/v1/api_types.py ``decode_BoolOrList``) refuses anything else before the request is served,
  the string ``"last"`` included: 400 ``{"error": "invalid type: string \"last\", expected a value
  or an array of values for BoolOrList"}``. (The Python dataclass behind it would take ``"last"``,
  managers/schedule_batch.py ``get_return_hidden_states_mode``; only an in-process engine gets there.)
- A mode above the server's is a ValueError, i.e. HTTP 400 ``{"error": {"message"}}``
  (managers/tokenizer_manager.py, the request validation before ``_create_tokenized_object``).
- Full mode: the prefill appends one ``[prompt_len][hidden]`` block, each decode step one
  ``[hidden]`` row, cut to the output length (managers/scheduler_components/
  batch_result_processor.py ``_append_prefill_hidden_states`` / ``_append_decode_hidden_states``,
  output_streamer.py ``hs[: req.finished_len]``). So max_new_tokens=1 gives ``[block]``.
  Last mode: one ``[hidden]`` vector, the last position's. The list goes to
  ``meta_info["hidden_states"]`` (tokenizer_manager.py ``_handle_batch_output``).
- Only the tokens the prefill computed get rows: a radix-cache hit or a chunked prefill returns
  fewer rows than the prompt has (budgetq's features worker checks the count).

The simulator's vectors are a cheap deterministic function of (token id, position, dimension),
so tests can check that row i belongs to token i.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from budgetq.simulator.runner import BadRequest
from budgetq.simulator.sampling import unexpected

# Request mode -> rank, as SGLang's CaptureHiddenMode orders them (NULL < LAST < FULL).
_RANK = {None: 0, "last": 1, "full": 2}
NOT_ENABLED = ("The server is not configured to return hidden states. Please set `--return-hidden-states-mode last`, "
               "`--return-hidden-states-mode full`, or the legacy `--enable-return-hidden-states` flag.")
BAD_MODE = "return_hidden_states must be a boolean or the string literal 'last'."


def exceeds(server_mode: str | None) -> str:
    return ("The requested return_hidden_states mode exceeds the server maximum "
            f"`{server_mode}`. Please launch with `--return-hidden-states-mode full` to allow "
            "return_hidden_states=True.")


def check_contract(value: Any) -> None:
    """The HTTP JSON contract gate (api/v1/api_types.py ``decode_BoolOrList``, run by
    entrypoints/api_contract.py before the request is served): a boolean or an array of booleans.
    So over HTTP the string ``"last"`` is refused here with serde's wording, before the Python
    dataclass (which would take it) sees it; null means unset."""
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, list):
        for v in value:
            if not isinstance(v, bool):
                raise BadRequest(f"invalid type: {unexpected(v)}, expected a boolean", kind="contract")
        return
    raise BadRequest(f"invalid type: {unexpected(value)}, expected a value or an array of values for BoolOrList",
                     kind="contract")


def _one(value: Any) -> str | None:
    if value is True:
        return "full"
    if value == "last" and isinstance(value, str):
        return "last"
    if value is False:
        return None
    raise BadRequest(BAD_MODE)


def request_modes(body: dict, n: int, server_mode: str | None) -> list[str | None]:
    """Per input: None, "last" or "full"; 400 with SGLang's messages when the server does not allow it."""
    value = body.get("return_hidden_states")
    value = False if value is None else value
    if isinstance(value, list):
        if len(value) != n:
            raise BadRequest("The length of return_hidden_states should be equal to the batch size.")
        modes = [_one(v) for v in value]
    else:
        modes = [_one(value)] * n
    wanted = max(_RANK[m] for m in modes) if modes else 0
    if wanted > _RANK[server_mode]:
        raise BadRequest(exceeds(server_mode) if server_mode else NOT_ENABLED)
    return modes


def vectors(ids: np.ndarray, positions: np.ndarray, hidden_size: int) -> np.ndarray:
    """float32 [len(ids), hidden_size]: value(t, p, j) = ((t*7919 + p*104729 + j*31) % 255 - 127) / 128.

    Multiples of 1/128 in [-0.99, 0.99]: exact in bfloat16, float16 and float32, so a test can compare
    what went through JSON, a dtype conversion and a shard bit for bit."""
    j = np.arange(hidden_size, dtype=np.int64)
    raw = (ids.astype(np.int64)[:, None] * 7919 + positions.astype(np.int64)[:, None] * 104729 + j[None, :] * 31)
    return ((raw % 255) - 127).astype(np.float32) / 128.0


def aux_vectors(ids: np.ndarray, positions: np.ndarray, hidden_size: int, layers: int) -> np.ndarray:
    """float32 [len(ids), layers * hidden_size]: the aux capture's layers side by side (layer l is
    ``vectors`` of ids shifted by 101 * (l + 1)), as ``--enable-return-aux-hidden-states`` concatenates them."""
    return np.concatenate([vectors(ids + 101 * (k + 1), positions, hidden_size) for k in range(layers)], axis=1)


def hidden_states(mode: str, prompt: list[int], output_ids: list[int], hidden_size: int, aux_layers: int = 0) -> Any:
    """meta_info.hidden_states for one finished request (numpy arrays: the response is written by orjson).

    aux_layers > 0: a server started with --enable-return-aux-hidden-states answers with the aux
    layers concatenated in place of the last layer (sglang/srt/arg_groups/fields/exec_.py)."""
    if aux_layers:
        def rows(ids: np.ndarray, pos: np.ndarray, size: int) -> np.ndarray:
            return aux_vectors(ids, pos, size, aux_layers)
    else:
        def rows(ids: np.ndarray, pos: np.ndarray, size: int) -> np.ndarray:
            return vectors(ids, pos, size)
    n = len(prompt)
    if mode == "last":
        if len(output_ids) > 1:  # the last decode step's row
            return rows(np.array(output_ids[-2:-1]), np.array([n + len(output_ids) - 2]), hidden_size)[0]
        return rows(np.array(prompt[-1:]), np.array([n - 1]), hidden_size)[0]
    block = rows(np.array(prompt), np.arange(n), hidden_size)
    out: list[Any] = [block]
    # Each decode step adds the row of the token it fed in: output token k-1 at position n+k-1.
    steps = output_ids[:-1]
    if steps:
        out.extend(rows(np.array(steps), np.arange(n, n + len(steps)), hidden_size))
    return out
