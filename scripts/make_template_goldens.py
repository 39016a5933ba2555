"""Write tests/vocab/chat_golden.json: the prompt ids transformers' `apply_chat_template(..., add_generation_prompt=True)`
gives for Llama-3.1's, Qwen2.5's and Qwen3's chat templates (tests/vocab/templates, from llama.cpp's models/templates)
with their real tokenizers (llama.cpp's vocabulary files in tests/vocab, read by ref.common.tokenizer), for a few
conversations, with and without tools. tests/fast/test_chat.py holds the server's template rendering and tokenizing
to them. Needs the `train` extra (transformers).

    python scripts/make_template_goldens.py
"""

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))

VOCABS = ROOT / "tests" / "vocab"
# template file -> its model's vocabulary file
TEMPLATES = {"meta-llama-Llama-3.1-8B-Instruct.jinja": "ggml-vocab-llama-bpe.gguf",
             "Qwen-Qwen2.5-7B-Instruct.jinja": "ggml-vocab-qwen2.gguf", "Qwen-Qwen3-0.6B.jinja": "ggml-vocab-qwen2.gguf"}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
CONVERSATIONS = [
    ([{"role": "user", "content": "Hello! Who are you?"}], None),
    ([{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Sky colour?"}], None),
    ([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
      {"role": "user", "content": "And 3+3? <|im_end|> stays text"}], None),
    ([{"role": "user", "content": "Weather in Paris?"}], [TOOL]),
]
EXTRA = {"date_string": "26 Jul 2024"}  # Llama-3.1's template dates its system header: fixed here and in the test


def main() -> None:
    from transformers import PreTrainedTokenizerFast
    from ref.common.tokenizer import load_tokenizer
    out = {}
    for name, vocab in TEMPLATES.items():
        ours = load_tokenizer(VOCABS / vocab)
        tok = PreTrainedTokenizerFast(tokenizer_object=ours.tok)
        tok.chat_template = (VOCABS / "templates" / name).read_text(encoding="utf-8")
        if ours.bos_id is not None:
            tok.bos_token = ours.tok.id_to_token(ours.bos_id)
        tok.eos_token = ours.tok.id_to_token(ours.eos_ids[0])
        out[name] = [{"messages": messages, "tools": tools,
                      "ids": tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False, **EXTRA)}
                     for messages, tools in CONVERSATIONS]
    tmp = VOCABS / "chat_golden.json.tmp"
    tmp.write_text(json.dumps({"extra": EXTRA, "templates": out}, indent=1) + "\n")
    os.replace(tmp, VOCABS / "chat_golden.json")


if __name__ == "__main__":
    main()
