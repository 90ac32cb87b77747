"""Reasoning output (issue 45): the ``glm45`` parser splits thinking from the answer, whole and streamed (tags split
across chunks at every position), and the server returns it as ``reasoning_content`` for a checkpoint whose chat
template thinks; ``chat_template_kwargs: {enable_thinking: false}`` turns it off where the template supports it."""

from __future__ import annotations

import pytest

from tests.serve_helpers import client, run, sse
from trtllm_glm.serve.reasoning import ReasoningParser, resolve_reasoning_parser, split_reasoning

pytestmark = pytest.mark.cpu_only

CASES = [
    # (prompt tail, output, reasoning, content)
    ("<|assistant|>", "<think>Let me see.</think>\nThe answer is 4.", "Let me see.", "The answer is 4."),
    ("<|assistant|>", "\n<think>a<b</think>x</think>y", "a<b", "x</think>y"),  # the first close ends it
    ("<|assistant|><think>", "plan: <think> is text here</think>\n\nDone", "plan: <think> is text here", "Done"),
    ("<|assistant|><think></think>", "Just the answer <think>", None, "Just the answer <think>"),
    ("<|assistant|>", "No thinking at all.", None, "No thinking at all."),
    ("<|assistant|>", "<thin", None, "<thin"),  # a partial tag that never completes is text
    ("<|assistant|><think>", "still thinking </thi", "still thinking </thi", ""),  # cut off by max_tokens
    ("<|assistant|>", "<think>", "", ""),
]


@pytest.mark.parametrize(("prompt", "text", "reasoning", "content"), CASES)
def test_whole_and_every_split(prompt: str, text: str, reasoning: str | None, content: str) -> None:
    assert split_reasoning(text, prompt) == (reasoning, content)
    # Streamed in two and three pieces at every cut: the same text comes out, in order.
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            p = ReasoningParser(prompt)
            rs, cs = [], []
            for piece in (text[:i], text[i:j], text[j:]):
                r, c = p.feed(piece)
                rs.append(r)
                cs.append(c)
            r, c = p.finish()
            assert ("".join(rs) + r, "".join(cs) + c) == (reasoning or "", content), (i, j)


def test_resolution() -> None:
    assert resolve_reasoning_parser("auto", "{{ x }}</think>") == "glm45"
    assert resolve_reasoning_parser("auto", "{{ x }}") is None and resolve_reasoning_parser(None, None) is None
    assert resolve_reasoning_parser("none", "</think>") is None and resolve_reasoning_parser("glm45", None) == "glm45"
    with pytest.raises(ValueError, match="reasoning parser"):
        resolve_reasoning_parser("qwen3", None)


# A GLM-style template: the generation prompt opens the thinking unless enable_thinking is false.
TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not enable_thinking %}"
    "<think></think>{% else %}<think>{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def thinking_app(tmp_path_factory):
    from trtllm_glm import LLM
    from trtllm_glm.models.glm5_next import Glm5NextForCausalLM
    from trtllm_glm.serve.app import build_app
    from trtllm_glm.serve.chat import load_chat_template
    from trtllm_glm.serve.engine import AsyncEngine
    from trtllm_glm.serve.reasoning import resolve_reasoning_parser

    d = tmp_path_factory.mktemp("thinking")
    Glm5NextForCausalLM.from_pretrained("tiny").save_pretrained(d)
    (d / "chat_template.jinja").write_text(TEMPLATE)
    tpl = load_chat_template(d)
    eng = AsyncEngine(LLM(model=str(d), device="cpu", max_seq_len=128, max_batch_size=4))
    eng.start()
    yield build_app(eng, served_model_name="m", chat_template=tpl, manage_engine=False,
                    reasoning_parser=resolve_reasoning_parser("auto", tpl.jinja))  # fmt: skip
    eng.stop(drain_timeout=0)


def _post(app, body: dict):
    async def main():
        async with client(app) as c:
            return await c.post("/v1/chat/completions", json=body)

    return run(main())


def test_server_returns_reasoning_content(thinking_app) -> None:
    """The template opens the thinking: the (random model's) text up to a closing tag is reasoning, streamed as
    its own deltas; with enable_thinking false it is all content; the two streams give the whole answers."""
    base = {"messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 12, "temperature": 0}
    r = _post(thinking_app, base)
    msg = r.json()["choices"][0]["message"]
    assert r.status_code == 200 and "reasoning_content" in msg, r.text
    assert len(msg["reasoning_content"]) + len(msg["content"]) > 0
    off = _post(thinking_app, {**base, "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert "reasoning_content" not in off["choices"][0]["message"]
    assert off["choices"][0]["message"]["content"]
    s = _post(thinking_app, {**base, "stream": True})
    events = [e for e in sse(s.text) if e != "[DONE]"]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == msg["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == msg["content"]
    bad = _post(thinking_app, {**base, "chat_template_kwargs": {"messages": []}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs", bad.text
