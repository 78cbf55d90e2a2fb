"""Hugging Face tokenizer files, both ways: ``HFTokenizer`` reads a checkpoint's own
``tokenizer.json`` as a ``Tokenizer`` (``model/tokenizer.py``); ``save_tokenizer(directory)``
writes the byte tokenizer and ChatML template as Hugging Face files.

``HFTokenizer``: a fast tokenizer (``tokenizer.json``, or Kimi's ``tiktoken.model``; slow and
remote-code tokenizers are a ValueError) from a local directory. The loop's special ids are found by their strings among the
added tokens (``SPECIAL_ROLES``: Qwen3's, which is ChatML plus ``<think>`` and ``<tool_call>``;
a vocabulary with harmony's tokens and no ``<|im_start|>`` takes ``model/harmony.HARMONY_ROLES``;
a vocabulary with Kimi's ``<|im_middle|>`` and no ``<|im_start|>`` takes ``model/kimi.KIMI_ROLES``);
a vocabulary without one of them is a ValueError naming it. A directory with Kimi's ``tiktoken.model``
and ``tokenizer_config.json`` instead of ``tokenizer.json`` is read by ``model/kimi.tiktoken_tokenizer``
(no remote code, no ``tiktoken`` package). ``encode`` runs the same
normalizer, pre-tokenizer and BPE without the added tokens, so text containing ``<|im_end|>``
becomes the ordinary tokens of those characters, never the special id (transformers' own
``encode`` would match it even with ``split_special_tokens``, which spares only tokens flagged
special, and Qwen3 flags ``<think>`` / ``<tool_call>`` as not special). ``encode_with_specials``
matches them: the chat template uses it for the text the template itself writes.

``save_tokenizer``:

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
import shutil
from collections.abc import Iterable
from pathlib import Path

from jointrl.model.chat_template import TOOL_INSTRUCTIONS
from jointrl.model.harmony import HARMONY_ROLES, HARMONY_TOKENS
from jointrl.model.kimi import KIMI_ROLES, KIMI_THINK, KIMI_TOKENS, NO_TOKEN, tiktoken_tokenizer
from jointrl.model.tokenizer import SPECIAL_TOKENS

# Tokenizer attribute -> the token string that plays that role (ChatML + Qwen3's reasoning / tools).
SPECIAL_ROLES: dict[str, str] = {
    "eos_id": "<|endoftext|>", "im_start_id": "<|im_start|>", "im_end_id": "<|im_end|>",
    "think_id": "<think>", "think_end_id": "</think>", "tool_call_id": "<tool_call>",
    "tool_call_end_id": "</tool_call>",
}
IMAGE_TOKENS = ("<image>", "<|image_pad|>")  # the first present is ``image_id``


class HFTokenizer:
    """A checkpoint directory's fast tokenizer as a ``Tokenizer`` (see the module docstring).

    ``hf`` is the ``PreTrainedTokenizerFast`` (its ``chat_template`` is the checkpoint's Jinja);
    ``vocab_size`` = ``len(hf)`` (base vocabulary plus added tokens; a model's embedding may be
    larger). ``pad_id`` is the tokenizer's pad token, else ``eos_id``."""

    def __init__(self, directory: str | Path) -> None:
        from tokenizers import Tokenizer as RawTokenizer
        from transformers import AutoTokenizer

        src = Path(directory)
        if (src / "tokenizer.json").is_file():
            self.hf = AutoTokenizer.from_pretrained(str(src), local_files_only=True, trust_remote_code=False)
        elif (src / "tiktoken.model").is_file() or (src / "tokenization_kimi.py").is_file():
            self.hf = tiktoken_tokenizer(src)  # Kimi's files, read without their remote code (model/kimi.py)
        else:
            raise ValueError(f"tokenizer: {str(src)!r} has no tokenizer.json (a fast Hugging Face tokenizer) "
                             "nor tiktoken.model with tokenizer_config.json (Kimi's)")
        if not self.hf.is_fast:
            raise ValueError(f"tokenizer: {str(src)!r} loads as a slow tokenizer; a tokenizer.json one is needed")
        self.special_ids: dict[str, int] = dict(self.hf.get_added_vocab())
        # harmony (gpt-oss) or Kimi: their tokens play the loop's roles (model/harmony.py, model/kimi.py);
        # else ChatML + Qwen3's
        self.harmony = "<|im_start|>" not in self.special_ids and all(
            t in self.special_ids for t in HARMONY_TOKENS.values())
        self.kimi = "<|im_start|>" not in self.special_ids and "<|im_middle|>" in self.special_ids
        if self.harmony:
            roles = HARMONY_ROLES
        elif self.kimi:
            roles = {**KIMI_ROLES, "think_id": KIMI_THINK[0], "think_end_id": KIMI_THINK[1]}
        else:
            roles = SPECIAL_ROLES
        required = ({**KIMI_ROLES, **KIMI_TOKENS} if self.kimi else roles).values()
        missing = [t for t in required if t not in self.special_ids]
        if missing:
            raise ValueError(f"tokenizer: {str(src)!r} lacks the special token(s) {missing} the agent loop needs "
                             f"(as added tokens of tokenizer.json or tokenizer_config.json)")
        for attr, text in roles.items():
            setattr(self, attr, self.special_ids.get(text, NO_TOKEN))  # only Kimi's <think> may be absent
        # stop ids besides im_end_id that end a turn (harmony's <|call|>); generate_turn adds them
        self.turn_stop_ids: tuple[int, ...] = (self.special_ids["<|call|>"],) if self.harmony else ()
        self.image_id: int | None = next((self.special_ids[t] for t in IMAGE_TOKENS if t in self.special_ids), None)
        self.pad_id: int = self.hf.pad_token_id if self.hf.pad_token_id is not None else self.eos_id
        self.vocab_size: int = len(self.hf)
        self.id_to_special = {i: t for t, i in self.special_ids.items()}
        raw = json.loads(self.hf.backend_tokenizer.to_str())
        raw["added_tokens"] = []
        self._plain = RawTokenizer.from_str(json.dumps(raw))
        self._full = self.hf.backend_tokenizer

    def encode(self, text: str) -> list[int]:
        """Plain text -> ids; never a special id (the added tokens are not matched)."""
        ids = self._plain.encode(text, add_special_tokens=False).ids
        assert not any(i in self.id_to_special for i in ids), "a special id from plain text"
        return ids

    def encode_with_specials(self, text: str) -> list[int]:
        """Text the chat template wrote -> ids, special-token strings becoming their ids."""
        return self._full.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Ids -> text, special tokens by their strings (left out with ``skip_special``). A model's
        embedding may have more rows than the tokenizer has tokens (Qwen3: 151,936 and 151,669);
        such ids can be sampled and decode to nothing."""
        ids = list(ids)
        if any(i < 0 for i in ids):
            raise ValueError(f"token id {min(ids)} is negative")
        ids = [i for i in ids if i < self.vocab_size and not (skip_special and i in self.id_to_special)]
        return self.hf.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


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


# A checkpoint's tokenizer, chat template and generation settings (what export copies as they came).
TOKENIZER_FILES = ("tokenizer.json", "tiktoken.model", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json", "generation_config.json")


def copy_tokenizer(source: str | Path, directory: str | Path) -> list[str]:
    """Copy ``TOKENIZER_FILES`` present in ``source`` into ``directory`` byte for byte; returns their names."""
    src, out = Path(source), Path(directory)
    if not (src / "tokenizer.json").is_file() and not (src / "tiktoken.model").is_file():
        raise ValueError(f"tokenizer: {str(src)!r} has no tokenizer.json or tiktoken.model to copy")
    copied = [name for name in TOKENIZER_FILES if (src / name).is_file()]
    for name in copied:
        shutil.copyfile(src / name, out / name)
    return copied


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
