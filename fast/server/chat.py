"""Chat templates: a model's `chat_template` (tokenizer_config.json, or a GGUF's tokenizer.chat_template) rendered
with sandboxed Jinja2 as transformers renders it; a model without one gets FALLBACK, a plain documented format.

transformers' environment: ImmutableSandboxedEnvironment(trim_blocks, lstrip_blocks) with loopcontrols, `tojson`,
`raise_exception` and `strftime_now`; variables `messages`, `add_generation_prompt`, `bos_token`, `eos_token`.
"""

import json
import math
import sys
import time
from datetime import datetime
from pathlib import Path

from ref.common.errors import UserError

# For base models (ReluLLaMA, ProSparse and the shipped model have no template): each message as "Role: content" on
# its own line, then "Assistant:" for the reply. It knows nothing of tools.
FALLBACK = ("{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}Assistant:{% endif %}")


MAX_TEXT = 1 << 24  # characters (or items) a template's * and ** may make: a prompt, not the machine's memory
# A render's budget: lines of the template's compiled code run (Qwen3's template runs about 20 a message, Llama-3.1's
# 8) and seconds, so that a template's loops end in an error instead of holding a worker thread (and the GIL).
MAX_LINES = 10_000_000
MAX_SECONDS = 10.0


class TemplateError(ValueError):
    """A request the template cannot render (the HTTP layer answers 400)."""


def sandbox():
    """transformers' sandboxed environment, with its repetitions bounded: 'a' * 400000000 in a model's template
    (or a power with a huge result) is refused instead of allocating gigabytes."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

    class Sandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                n, seq = (right, left) if isinstance(right, int) else (left, right)
                if isinstance(n, int) and hasattr(seq, "__len__") and n * len(seq) > MAX_TEXT:
                    raise SecurityError(f"the template repeats {len(seq)} items {n} times")
            elif isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right * math.log2(abs(left)) > 4096:
                raise SecurityError(f"the template raises {left} to the power {right}")
            return super().call_binop(context, operator, left, right)

    return Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])


def model_template(path: Path) -> str | None:
    """A model folder's chat_template (tokenizer_config.json; a list of named templates: the 'default' one), or a
    GGUF file's tokenizer.chat_template; None when it has none."""
    path = Path(path)
    if path.is_dir():
        cfg = path / "tokenizer_config.json"
        if not cfg.is_file():
            return None
        try:
            meta = json.loads(cfg.read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"{cfg}: not valid JSON ({e})") from None
        if not isinstance(meta, dict):
            raise UserError(f"{cfg}: not a JSON object")
        t = meta.get("chat_template")
        if isinstance(t, list):
            t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
        return t if isinstance(t, str) else None
    from ref.common.gguf_io import gguf_metadata
    t = gguf_metadata(path).get("tokenizer.chat_template")
    return t if isinstance(t, str) else None


class ChatTemplate:
    """Renders messages into a prompt string."""

    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = ""):
        from jinja2 import TemplateSyntaxError

        self.is_fallback = source is None
        env = sandbox()
        env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = self.raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(FALLBACK if source is None else source)
        except TemplateSyntaxError as e:
            raise UserError(f"chat template: {e}") from None
        self.bos_token, self.eos_token = bos_token, eos_token

    @classmethod
    def of(cls, source: str | None, tokenizer) -> "ChatTemplate":
        """A template with the tokenizer's BOS and first EOS as `bos_token` and `eos_token`."""
        def text(i):
            return (tokenizer.tok.id_to_token(i) or "") if i is not None else ""
        return cls(source, text(tokenizer.bos_id), text(tokenizer.eos_ids[0] if tokenizer.eos_ids else None))

    @staticmethod
    def raise_exception(message):
        raise TemplateError(message)

    def encode(self, tokenizer, text: str) -> list[int]:
        """A rendered prompt's ids as transformers' apply_chat_template gives them: the template writes BOS where the
        model wants one (`bos_token`), so none is added; the plain fallback, which has no BOS, gets the model's."""
        return tokenizer.encode(text, bos=self.is_fallback)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        """The prompt text, within the budget (MAX_LINES of the template run, MAX_SECONDS)."""
        if self.is_fallback and extra.get("tools"):
            raise TemplateError("this model has no chat template, and the plain fallback has no tools")
        outer = sys.gettrace()
        sys.settrace(Budget(MAX_LINES, MAX_SECONDS))  # this thread's frames from here on
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token, eos_token=self.eos_token, **extra)
        except TemplateError:
            raise
        except Exception as e:  # a template that fails on this input (jinja2's errors, a sandbox violation)
            raise TemplateError(f"the chat template failed on these messages: {e}") from None
        finally:
            sys.settrace(outer)


class Budget:
    """A trace function that counts the lines a template's compiled code runs (frames of jinja2's '<template>'; no
    other frame is traced) and ends the render with a TemplateError past `lines` of them or `seconds`."""

    def __init__(self, lines: int, seconds: float):
        self.left, self.lines, self.seconds = lines, lines, seconds
        self.deadline = time.monotonic() + seconds

    def __call__(self, frame, event, arg):
        return self.line if frame.f_code.co_filename == "<template>" else None

    def line(self, frame, event, arg):
        if event == "line":
            self.left -= 1
            if self.left <= 0:
                raise TemplateError(f"the chat template ran over {self.lines:,} lines on these messages")
            if self.left % 1024 == 0 and time.monotonic() > self.deadline:
                raise TemplateError(f"the chat template ran over {self.seconds:g} s on these messages")
        return self.line
