"""Byte-level tokenizer with the chat template's special tokens (no download, works offline).

Ids 0..255 are raw bytes; the special tokens follow. ``encode`` never produces a special
id: text that *contains* ``<|im_end|>`` or ``<tool_call>`` is encoded as its plain bytes.
Only the chat template (``jointrl.model.chat_template``) places special ids.
"""

from __future__ import annotations

from collections.abc import Iterable

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",  # padding / end of document
    "<|im_start|>",
    "<|im_end|>",  # end of turn: the engine's stop token
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<image>",
)


class ByteTokenizer:
    """``vocab_size`` = 256 + len(SPECIAL_TOKENS) = 264."""

    def __init__(self) -> None:
        self.special_ids: dict[str, int] = {t: 256 + i for i, t in enumerate(SPECIAL_TOKENS)}
        self.id_to_special: dict[int, str] = {i: t for t, i in self.special_ids.items()}
        self.vocab_size = 256 + len(SPECIAL_TOKENS)
        self.pad_id = self.special_ids["<|endoftext|>"]
        self.im_start_id = self.special_ids["<|im_start|>"]
        self.im_end_id = self.special_ids["<|im_end|>"]
        self.think_id = self.special_ids["<think>"]
        self.think_end_id = self.special_ids["</think>"]
        self.tool_call_id = self.special_ids["<tool_call>"]
        self.tool_call_end_id = self.special_ids["</tool_call>"]

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Bytes are decoded as UTF-8 (invalid sequences become U+FFFD); specials by name."""
        out: list[str] = []
        buf = bytearray()
        for i in ids:
            if i < 256:
                buf.append(i)
                continue
            if buf:
                out.append(buf.decode("utf-8", errors="replace"))
                buf.clear()
            if i not in self.id_to_special:
                raise ValueError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")
            if not skip_special:
                out.append(self.id_to_special[i])
        if buf:
            out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)
