"""Chat templates: rendered in transformers' sandbox, with what a model's template may make bounded."""

import json

import pytest

pytest.importorskip("jinja2")
from fast.server.chat import MAX_TEXT, ChatTemplate, TemplateError, model_template  # noqa: E402
from ref.common.errors import UserError  # noqa: E402
from ref.common.tokenizer import load_tokenizer  # noqa: E402
from tests.helpers import ROOT  # noqa: E402

VOCABS = ROOT / "tests" / "vocab"

HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("source, want", [
    (None, "User: hi\nAssistant:"),
    ("{{ 'ab' * 3 }}{{ 2 ** 10 }}{{ [1] * 2 }}{{ 1.5 * 2 }}", "ababab1024[1, 1]3.0"),  # ordinary arithmetic
    ("{% for m in messages %}{{ m['role'] | upper }}{% endfor %}{{ messages | tojson }}",
     'USER[{"role": "user", "content": "hi"}]'),
])
def test_renders(source, want):
    assert ChatTemplate(source).render(HI) == want


@pytest.mark.parametrize("source", ["{{ 'a' * 400000000 }}", "{{ 400000000 * 'a' }}", "{{ [0] * (2 ** 30) }}",
                                    "{{ 10 ** 100000 }}"])
def test_what_a_template_may_make_is_bounded(source):
    """Repetitions past MAX_TEXT items and powers past 4096 bits are refused (they took 1.8 GB and seconds)."""
    with pytest.raises(TemplateError):
        ChatTemplate(source).render(HI)
    assert MAX_TEXT < 400_000_000


LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def test_a_templates_loops_end_within_its_budget(monkeypatch):
    """Two nested range(100000) loops (10^10 iterations) end in a TemplateError at MAX_LINES, or at MAX_SECONDS of a
    slower template; a render within the budget is untouched, and the caller's trace function is given back."""
    import sys
    import time
    from fast.server import chat
    with pytest.raises(TemplateError, match="ran over 10,000,000 lines"):
        ChatTemplate(LOOPS).render(HI)
    monkeypatch.setattr(chat, "MAX_SECONDS", 0.2)
    t0 = time.monotonic()
    with pytest.raises(TemplateError, match="ran over 0.2 s"):
        ChatTemplate("{% for i in range(100000) %}{% for j in range(100000) %}{{ i ~ j ~ messages }}{% endfor %}"
                     "{% endfor %}").render(HI)
    assert time.monotonic() - t0 < 2
    outer = sys.gettrace()
    assert ChatTemplate("{% for i in range(1000) %}{% endfor %}ok").render(HI) == "ok" and sys.gettrace() is outer


def test_a_template_that_does_not_compile_is_one_line():
    with pytest.raises(UserError, match="chat template: "):
        ChatTemplate("{% for m in messages %}")


@pytest.mark.parametrize("text, message", [("[1, 2]", "not a JSON object"), ("{", "not valid JSON")])
def test_a_bad_tokenizer_config_is_one_line(tmp_path, text, message):
    (tmp_path / "tokenizer_config.json").write_text(text)
    with pytest.raises(UserError, match=message):
        model_template(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "x"}))
    assert model_template(tmp_path) == "x"


GOLDEN = json.loads((VOCABS / "chat_golden.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("name, case", [(name, i) for name, cases in GOLDEN["templates"].items()
                                        for i in range(len(cases))])
def test_prompt_ids_are_apply_chat_templates(name, case):
    """Llama-3.1's, Qwen2.5's and Qwen3's templates with their real tokenizers (llama.cpp's vocabulary files): the
    server's prompt ids for a conversation (tools included) are transformers' apply_chat_template(...,
    add_generation_prompt=True), one BOS where the template writes it (scripts/make_template_goldens.py)."""
    g = GOLDEN["templates"][name][case]
    tok = load_tokenizer(VOCABS / ("ggml-vocab-llama-bpe.gguf" if name.startswith("meta-llama") else "ggml-vocab-qwen2.gguf"))
    t = ChatTemplate.of((VOCABS / "templates" / name).read_text(encoding="utf-8"), tok)
    text = t.render(g["messages"], tools=g["tools"], add_generation_prompt=True, **GOLDEN["extra"])
    assert t.encode(tok, text) == g["ids"]
