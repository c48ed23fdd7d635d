"""features.vllm.single_pass without an engine: what the generation request asks, what the row keeps, and which
engine files the features job may store (tests/test_vllm_features.py runs it on vLLM itself)."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from pydantic import ValidationError

from budgetq.hidden_states.capture.decode import HiddenStatesError
from budgetq.hidden_states.capture.vllm_backend import generation_sample
from budgetq.hidden_states.schema import FeaturesPayload
from budgetq.hidden_states.store.safetensors_io import Tensor, write_atomic
from budgetq.hidden_states.store.shards import FeatureStore
from budgetq.shared.config import Config, ServerConfig
from budgetq.shared.schema import JobPayload, Message, ResultRow, SamplingParams
from budgetq.worker import sglang_client
from budgetq.worker.process import build_row
from budgetq.worker.sglang_wire import build_request, parse_response


def _payload(hidden_states_dir: str | None, temperature: float = 0.0) -> JobPayload:
    return JobPayload(id="p1", dataset="A", messages=[Message(role="user", content="héllo ✓")],
                      sampling=SamplingParams(max_tokens=8, temperature=temperature),
                      hidden_states_dir=hidden_states_dir)


def _chat_answer(kv: object = None) -> dict:
    body: dict = {"choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}],
                  "usage": {"prompt_tokens": 5, "completion_tokens": 2}}
    if kv is not None:
        body["kv_transfer_params"] = kv
    return body


def test_a_vllm_request_names_a_file_per_attempt_with_the_output_tokens_and_sglang_gets_none():
    server = ServerConfig(urls=["http://h:1"], model="m")
    _, body = build_request(server, _payload("/store/A/features/engine/"), "A-p1.0123456789ab", sglang=False)
    assert body["kv_transfer_params"] == {
        "hidden_states_path": "/store/A/features/engine/A-p1.0123456789ab.safetensors", "include_output_tokens": True}
    _, body = build_request(server, _payload("/store/A/features/engine"), "A-p1.0123456789ab", sglang=True)
    assert "kv_transfer_params" not in body
    _, body = build_request(server, _payload(None), "A-p1.0123456789ab", sglang=False)
    assert "kv_transfer_params" not in body


def test_the_row_keeps_the_engine_file_only_when_the_server_wrote_one():
    payload = _payload("/store/A/features/engine")
    for kv, want in (({"hidden_states_path": "/s/f.safetensors"}, "/s/f.safetensors"), (None, None),
                     ({"hidden_states_path": 7}, None), ("not a dict", None)):
        out = parse_response("chat", _chat_answer(kv), "http://h:1", 0.0)
        assert out.hidden_states_file == want
        line = build_row(payload, out, "m").model_dump_json()
        assert json.loads(line).get("hidden_states_file") == want
        assert ("hidden_states_file" in json.loads(line)) is (want is not None)
        assert ResultRow.model_validate_json(line).hidden_states_file == want


def test_a_temperature_above_zero_is_warned_once_per_dataset(caplog):
    async def main() -> None:
        import aiohttp

        async with aiohttp.ClientSession() as session:
            client = sglang_client.SGLangClient(session, ServerConfig(urls=["http://127.0.0.1:9"], model="m"))
            client.pool.endpoints[0].kind = "vllm"  # known: no detection round trip
            for _ in range(2):
                with pytest.raises(Exception):  # noqa: B017 - nothing listens on port 9: the send fails after the warning
                    await client._once(client.pool.endpoints[0], _payload("/s/A/features/engine", 0.7), "A-p1.0")

    sglang_client._WARNED_SAMPLING.discard("A")
    with caplog.at_level("WARNING", logger="budgetq.worker"):
        asyncio.run(main())
    warned = [r.getMessage() for r in caplog.records if "single_pass at temperature 0.7" in r.getMessage()]
    assert len(warned) == 1 and "dataset A" in warned[0] and "CPU build" in warned[0], warned


def _engine_file(path, ids: list[int]) -> str:
    write_atomic(path, [Tensor("token_ids", "I64", [len(ids)], np.asarray(ids, "<i8").tobytes()),
                        Tensor("hidden_states", "F32", [len(ids), 1, 2], np.zeros((len(ids), 2), "<f4").tobytes())],
                 {})
    return str(path)


def test_an_engine_file_is_stored_only_as_a_prefix_of_the_template_reaching_into_the_answer(tmp_path):
    payload = FeaturesPayload(id="p1", dataset="A", input_ids=[1, 2, 3, 4, 5, 6, 7], loss_start=3, loss_end=7)
    # prompt + answer but the last sampled token: the end-of-turn tokens are cut, and the loss span with them
    got = generation_sample(_engine_file(tmp_path / "a.safetensors", [1, 2, 3, 4, 5]), payload)
    assert got.input_ids == [1, 2, 3, 4, 5] and (got.loss_start, got.loss_end) == (3, 5) and got.engine_file is None
    assert got.loss_mask() == [0, 0, 0, 1, 1]
    with pytest.raises(HiddenStatesError, match="differ from the chat template's 7 at position 3"):
        generation_sample(_engine_file(tmp_path / "b.safetensors", [1, 2, 3, 9, 5]), payload)
    with pytest.raises(HiddenStatesError, match="differ from the chat template's 7 at position 7"):
        generation_sample(_engine_file(tmp_path / "c.safetensors", [1, 2, 3, 4, 5, 6, 7, 8]), payload)
    with pytest.raises(HiddenStatesError, match="end before the answer"):
        generation_sample(_engine_file(tmp_path / "d.safetensors", [1, 2, 3]), payload)
    (tmp_path / "e.safetensors").write_bytes(b"\x00\x01garbage")
    with pytest.raises(HiddenStatesError, match="not readable"):
        generation_sample(str(tmp_path / "e.safetensors"), payload)


def test_single_pass_needs_the_vllm_backend_and_a_store_and_names_the_engine_folder(tmp_path):
    with pytest.raises(ValidationError, match="features.vllm.single_pass needs features.backend vllm"):
        Config.model_validate({"features": {"vllm": {"single_pass": True}}})
    cfg = Config.model_validate({"features": {"backend": "vllm", "store": "/vol/hs/", "model": {"path": "/m"},
                                              "server": {"urls": ["http://h:1"]}, "vllm": {"single_pass": True}}})
    assert cfg.features.engine_dir("A") == "/vol/hs/A/features/engine"
    cfg.features.vllm.single_pass = False
    assert cfg.features.engine_dir("A") is None


def test_the_end_of_a_pass_removes_engine_files_no_row_kept(tmp_path):
    store = FeatureStore(tmp_path, "A", 2**20)
    engine = store.dir / "engine"
    engine.mkdir()
    _engine_file(engine / "A-p1.0123456789ab.safetensors", [1, 2])
    (engine / "A-p1.0123456789ab.safetensors.lock").write_text("")
    assert store.sweep_leftovers() == 2 and not list(engine.iterdir())


def test_a_row_naming_a_file_outside_the_engine_folder_is_prefilled_and_the_file_left_alone(tmp_path):
    from budgetq.hidden_states.capture.vllm_backend import VllmBackend

    cfg = Config.model_validate({"features": {"backend": "vllm", "store": str(tmp_path / "store"),
                                              "model": {"path": str(tmp_path)}, "server": {"urls": ["http://h:1"]}}})
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    payload = FeaturesPayload(id="p1", dataset="A", input_ids=[1, 2, 3], loss_start=1, loss_end=3,
                              engine_file=str(tmp_path / "store" / "A" / "features" / "engine" / ".." / ".." / ".."
                                              / ".." / "precious.txt"))
    assert asyncio.run(VllmBackend(cfg)._from_generation(payload, payload.engine_file or "")) is None
    assert victim.read_text() == "keep me"
