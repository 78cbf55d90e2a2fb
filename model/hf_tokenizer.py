"""The byte tokenizer and ChatML template as Hugging Face files: ``save_tokenizer(directory)``.

Writes what ``transformers.AutoTokenizer.from_pretrained(directory)`` reads: ``tokenizer.json``
(a byte-level BPE with no merges, so byte ``b`` is id ``b``, then the special tokens at 256..263
as in ``model/tokenizer.py``), ``tokenizer_config.json`` and ``chat_template.jinja``. The
Jinja template renders what ``model/chat_template.ChatTemplate.render`` renders (tools in the
system turn, ``<think>`` reasoning, ``<tool_call>`` JSON, the generation prompt opening
``<think>``), so the rendered text is the same (tested). Token ids are the same too, except
where text contains a special token's string: HF tokenizers split such text into the special
id, ``ByteTokenizer`` keeps plain bytes. That includes the literal ``<tool_call>`` example in
the tool instructions, so a prompt with tools tokenizes differently in HF than in training
(the model saw those bytes, not the ids); a serving stack should tokenize with our template.
"""

from __future__ import annotations

import json
from pathlib import Path

from jointrl.model.chat_template import TOOL_INSTRUCTIONS
from jointrl.model.tokenizer import SPECIAL_TOKENS


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what the ByteLevel pre-tokenizer emits)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def chat_template_jinja() -> str:
    """ChatTemplate.render as Jinja (transformers' ``tojson`` keeps key order and ``json.dumps``'s
    separators, so tool specs and calls come out byte for byte)."""
    head, tail = TOOL_INSTRUCTIONS.replace("{{", "{").replace("}}", "}").split("{tools}")
    q = json.dumps  # a JSON string literal is a valid Jinja string literal here (ASCII text)
    return (
        "{%- set ns = namespace(block='') -%}"
        "{%- if tools -%}"
        f"{{%- set ns.block = {q(head)} + tools | map('tojson', ensure_ascii=True) | join('\\n') + {q(tail)} -%}}"
        "{%- endif -%}"
        "{%- if ns.block and (not messages or messages[0].role != 'system') -%}"
        "{{- '<|im_start|>system\\n' + ns.block[2:] + '<|im_end|>\\n' -}}"
        "{%- endif -%}"
        "{%- for m in messages -%}"
        "{{- '<|im_start|>' + m.role + '\\n' -}}"
        "{%- if m.role == 'assistant' -%}"
        "{{- '<think>' + (m.reasoning_content or '') + '</think>' + (m.content or '') -}}"
        "{%- for c in m.tool_calls or [] -%}"
        "{%- set f = c.function if c.function is defined else c -%}"
        "{{- '<tool_call>' + {'name': f.name, 'arguments': f.arguments} | tojson + '</tool_call>' -}}"
        "{%- endfor -%}"
        "{%- else -%}"
        "{{- m.content -}}{%- if loop.first and m.role == 'system' -%}{{- ns.block -}}{%- endif -%}"
        "{%- endif -%}"
        "{{- '<|im_end|>\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n<think>' -}}{%- endif -%}"
    )


def save_tokenizer(directory: str | Path) -> Path:
    """Write the tokenizer files and chat template into ``directory``; returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    vocab = {c: b for b, c in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))  # ids 256.. in order, as ByteTokenizer
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   model_max_length=1 << 20)
    fast.chat_template = chat_template_jinja()
    fast.save_pretrained(str(out))
    return out
