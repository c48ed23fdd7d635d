"""The simulator speaks SGLang's shapes (real HTTP)."""

import json
import urllib.error
import urllib.request


def _post(url: str, body: dict, ctype: str = "application/json"):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": ctype})
    try:
        with urllib.request.urlopen(req) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_chat_generate_and_info_shapes(sim_factory):
    sim = sim_factory("--speedup", "1000", "--length-mean", "100")
    status, body = _post(sim + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                        "max_tokens": 10, "rid": "A1-x"})
    assert status == 200 and body["object"] == "chat.completion" and body["id"] == "A1-x"
    ch = body["choices"][0]
    assert ch["message"]["role"] == "assistant" and "reasoning_content" in ch["message"]
    assert ch["finish_reason"] in ("stop", "length") and body["usage"]["completion_tokens"] <= 10
    status, body = _post(sim + "/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 1}})
    assert status == 200 and body["meta_info"]["finish_reason"] == {"type": "length", "length": 1}
    assert len(body["output_ids"]) == 1
    with urllib.request.urlopen(sim + "/v1/models") as r:
        assert json.loads(r.read())["data"][0]["owned_by"] == "sglang"
    with urllib.request.urlopen(sim + "/get_model_info") as r:
        assert json.loads(r.read())["is_generation"] is True


def test_errors_use_sglang_flat_body(sim_factory):
    sim = sim_factory("--error-rate", "1.0")
    status, body = _post(sim + "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
    assert status == 503 and body["object"] == "error" and body["code"] == 503
    status, body = _post(sim + "/v1/chat/completions", {"messages": []}, ctype="text/plain")
    assert status == 400 and "Content-Type" in body["message"]
