"""Inputs that used to give a 500 or a misleading message (issue 33): a lone surrogate in prompt text or chat
content, a deeply nested body, a text part without text; and /metrics right after start-up."""

from __future__ import annotations

import pytest

from tests.serve_helpers import client, make_llm, run, sse
from trtllm_glm.serve.app import build_app
from trtllm_glm.serve.engine import AsyncEngine

pytestmark = pytest.mark.cpu_only

# JSON escapes, so that the body carries the lone surrogate as a client's JSON encoder would send it.
LONE = '"\\ud800abc"'


def post_raw(app, path: str, body: str):
    async def main():
        async with client(app) as c:
            return await c.post(path, content=body.encode(), headers={"content-type": "application/json"})

    return run(main())


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", '{"prompt": ' + LONE + ', "max_tokens": 2}', "prompt"),
        ("/v1/completions", '{"prompt": ["ok", ' + LONE + '], "max_tokens": 2}', "prompt.1"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": ' + LONE + "}]}", "messages.0.content"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": ' + LONE
         + "}]}]}", "messages.0.content.0.text"),
    ],
)  # fmt: skip
def test_lone_surrogate_is_a_400(app, path, body, param) -> None:
    r = post_raw(app, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "lone surrogate" in err["message"], err


@pytest.mark.parametrize("depth", [100, 100_000])
def test_deeply_nested_body_is_a_400(app, depth) -> None:
    body = '{"prompt": "x", "max_tokens": 2, "logit_bias": ' + "[" * depth + "]" * depth + "}"
    r = post_raw(app, "/v1/completions", body)
    assert r.status_code == 400, r.text[:300]


def test_text_part_without_text_says_so(app) -> None:
    r = post_raw(app, "/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text"}]}]}')
    assert r.status_code == 400
    assert "a text part needs a 'text' string" in r.json()["error"]["message"]


def test_max_tokens_beyond_the_context_names_the_limit(app) -> None:
    r = post_raw(app, "/v1/completions", '{"prompt": "hi", "max_tokens": 1000000000}')
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "max_tokens" and err["code"] == "context_length_exceeded"
    assert "at most 253" in err["message"]  # 256 - BOS and two bytes


def test_metrics_show_the_pool_from_start_and_no_created_series() -> None:
    """The page pool used to read 0 until the first request; ``*_created`` series doubled the page."""
    eng = AsyncEngine(make_llm(max_batch_size=2, max_seq_len=64))
    app = build_app(eng, served_model_name="tiny", manage_engine=False)

    async def main():
        async with client(app) as c:
            return (await c.get("/metrics")).text

    text = run(main())
    total = eng.executor.manager.num_pages
    assert total > 0 and f"trtllm:kv_cache_pages_total {float(total)}" in text
    assert "_created" not in text and "trtllm:request_finished_total" in text


def test_checkpoint_without_tokenizer_serves_token_ids_and_refuses_text(tmp_path) -> None:
    from trtllm_glm import LLM
    from trtllm_glm.config import PRESETS, Glm5NextConfig
    from trtllm_glm.models.glm5_next import Glm5NextForCausalLM

    cfg = Glm5NextConfig.from_dict({**PRESETS["tiny"], "vocab_size": 320, "pad_token_id": 0, "bos_token_id": 1,
                                    "eos_token_id": 2})  # fmt: skip
    Glm5NextForCausalLM.from_config(cfg, seed=0).save_pretrained(tmp_path)
    eng = AsyncEngine(LLM(model=str(tmp_path), device="cpu", max_seq_len=64, max_batch_size=2))
    eng.start()
    try:
        app = build_app(eng, served_model_name="m", manage_engine=False)
        ok = post_raw(app, "/v1/completions", '{"prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": true, '
                      '"temperature": 0}')  # fmt: skip
        streamed = post_raw(app, "/v1/completions", '{"prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": true, '
                            '"stream": true, "temperature": 0}')  # fmt: skip
        text = post_raw(app, "/v1/completions", '{"prompt": "hello", "max_tokens": 3}')
        chat = post_raw(app, "/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}]}')
    finally:
        eng.stop(drain_timeout=0)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    # Without a tokenizer the text is empty: the ids come back (issue 45, item 9), streamed too.
    choice = ok.json()["choices"][0]
    assert choice["prompt_token_ids"] == [5, 6, 7] and len(choice["token_ids"]) == 3 and choice["text"] == ""
    events = [e for e in sse(streamed.text) if e != "[DONE]"]
    got = [t for e in events for c in e["choices"] for t in c.get("token_ids", [])]
    assert got == choice["token_ids"] and events[0]["choices"][0]["prompt_token_ids"] == [5, 6, 7]
    for r in (text, chat):
        assert r.status_code == 400 and "has no tokenizer.json" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("stop", [LONE, '["ok", ' + LONE + "]"])
def test_stop_string_with_a_lone_surrogate_is_a_400(app, stop) -> None:
    """Issue 45: prompts with a lone surrogate were refused but stop strings with one were accepted."""
    r = post_raw(app, "/v1/completions", '{"prompt": "hi", "max_tokens": 2, "stop": ' + stop + "}")
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "stop" and "lone surrogate" in err["message"], err


@pytest.mark.parametrize(
    ("message", "status", "param"),
    [
        ('{"role": "user", "content": "hi", "tool_calls": null}', 200, None),
        ('{"role": "assistant", "content": "hi", "tool_calls": [], "refusal": null}', 200, None),
        ('{"role": "user", "content": "hi", "colour": "red"}', 400, "messages.0.colour"),
        ('{"role": "assistant", "content": "", "tool_calls": [{"id": "c1"}]}', 400, "messages.0"),
    ],
)
def test_unknown_keys_inside_a_chat_message_are_refused_by_name(app, message, status, param) -> None:
    """Issue 45: unknown keys inside a message were ignored while unknown top-level fields got a 400; empty
    tool-call keys that clients send with every turn stay accepted."""
    body = '{"messages": [' + message + '], "max_tokens": 2, "temperature": 0}'
    r = post_raw(app, "/v1/chat/completions", body)
    assert r.status_code == status, r.text
    if status == 400:
        assert r.json()["error"]["param"] == param, r.text


def test_unknown_field_named_by_a_lone_surrogate_is_named(app) -> None:
    """Issue 45, item 7: the 400 for an unknown field whose name is a lone surrogate names it (was param null)."""
    r = post_raw(app, "/v1/completions", '{"prompt": "hi", "max_tokens": 2, ' + LONE + ": 1}")
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "\\ud800abc" and "unsupported parameter" in err["message"], err
    # the same key nested in a chat message is named with its path (pydantic reports it)
    r = post_raw(app, "/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi", ' + LONE + ": 1}]}")
    assert r.status_code == 400 and r.json()["error"]["param"] is not None, r.text


def test_return_token_ids(app) -> None:
    """vLLM's ``return_token_ids``: the prompt's and the choices' ids with the text, for completions and chat."""
    r = post_raw(app, "/v1/completions", '{"prompt": "hello", "max_tokens": 4, "temperature": 0, "n": 2, '
                 '"return_token_ids": true}')  # fmt: skip
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        assert c["prompt_token_ids"] == app.state.engine.tokenizer.encode("hello") and len(c["token_ids"]) == 4
    plain = post_raw(app, "/v1/completions", '{"prompt": "hello", "max_tokens": 4, "temperature": 0}')
    assert "token_ids" not in plain.json()["choices"][0]
    chat = post_raw(app, "/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, '
                    '"return_token_ids": true}')  # fmt: skip
    body = chat.json()
    assert body["prompt_token_ids"] and len(body["choices"][0]["token_ids"]) == body["usage"]["completion_tokens"]
