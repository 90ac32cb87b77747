"""Chat templates: the preset one, and a checkpoint's Jinja template from ``tokenizer_config.json``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.serve_helpers import MODEL, client, run
from trtllm_glm.runtime.tokenizer import ByteTokenizer
from trtllm_glm.serve.app import build_app
from trtllm_glm.serve.chat import ChatTemplate, ChatTemplateError, load_chat_template

pytestmark = pytest.mark.cpu_only

TOK = ByteTokenizer(264, bos_id=256, eos_id=257, pad_id=258)
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
JINJA = (
    "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


def test_preset_template() -> None:
    t = load_chat_template("tiny")
    assert t.jinja is None and t.source == "preset"
    text = t.render(MSGS)
    assert text == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    assert t.encode(TOK, MSGS) == [256, *text.encode()]
    assert t.render(MSGS, add_generation_prompt=False).endswith("Hi\n")


def test_checkpoint_template_from_tokenizer_config(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": [{"name": "default", "template": JINJA}], "bos_token": {"content": "<s>"}})
    )
    t = load_chat_template(tmp_path)
    assert t.source.endswith("tokenizer_config.json")
    assert t.render(MSGS) == "<s>[system]Be brief.\n[user]Hi\n[assistant]"
    # The template writes its own specials: no BOS id is added in front.
    assert t.encode(TOK, MSGS) == list(b"<s>[system]Be brief.\n[user]Hi\n[assistant]")
    # chat_template.jinja takes precedence.
    (tmp_path / "chat_template.jinja").write_text("{{ raise_exception('no chat here') }}")
    with pytest.raises(ChatTemplateError, match="no chat here"):
        load_chat_template(tmp_path).render(MSGS)
    (tmp_path / "chat_template.jinja").write_text("{% for %}")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        load_chat_template(tmp_path)


def test_server_uses_the_given_template(engine) -> None:
    app = build_app(engine, served_model_name=MODEL, chat_template=ChatTemplate(jinja=JINJA), manage_engine=False)
    bad = build_app(engine, served_model_name=MODEL, manage_engine=False,
                    chat_template=ChatTemplate(jinja="{{ raise_exception('only user turns') }}"))  # fmt: skip

    async def main():
        async with client(app) as c, client(bad) as b:
            body = {"messages": MSGS, "max_tokens": 2}
            return await c.post("/v1/chat/completions", json=body), await b.post("/v1/chat/completions", json=body)

    ok, err = run(main())
    assert ok.status_code == 200
    assert ok.json()["usage"]["prompt_tokens"] == len("[system]Be brief.\n[user]Hi\n[assistant]")
    assert err.status_code == 400 and "only user turns" in err.json()["error"]["message"]
