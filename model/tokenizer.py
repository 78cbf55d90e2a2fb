"""The ``Tokenizer`` protocol the loop reads, and the byte-level tokenizer that implements it
(no download, works offline).

``Tokenizer``: ids <-> text plus the special ids the agent loop, parser, engine and learner
need. Two implementations: ``ByteTokenizer`` (here) and ``HFTokenizer`` (``model/hf_tokenizer.py``,
a checkpoint's own ``tokenizer.json``). Both keep one contract: ``encode`` never produces a
special id, so text that *contains* ``<|im_end|>`` or ``<tool_call>`` is encoded as plain
text; only the chat template places special ids.

ByteTokenizer: ids 0..255 are raw bytes; the special tokens follow.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

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


@runtime_checkable
class Tokenizer(Protocol):
    """What the loop needs of a tokenizer. The ids name roles, not strings: ``im_start_id`` /
    ``im_end_id`` open and end a turn (``im_end_id`` is the engine's stop token), ``think_id`` /
    ``think_end_id`` open and close reasoning, ``tool_call_id`` / ``tool_call_end_id`` wrap one
    call's JSON, ``eos_id`` ends a document, ``pad_id`` pads batches, ``image_id`` is an image slot
    (None where the vocabulary has none). ``special_ids`` maps every special token's string to
    its id. ``encode(text)`` never returns an id in ``special_ids``' values. ``harmony``: the
    roles are played by harmony's tokens (gpt-oss, model/harmony.py); ``turn_stop_ids``: stop ids
    besides ``im_end_id`` that end a turn (harmony's ``<|call|>``); ``kimi``: the roles are played by
    Kimi's tokens (model/kimi.py: tool calls in a ``<|tool_calls_section_begin|>`` section)."""

    vocab_size: int
    special_ids: dict[str, int]
    pad_id: int
    eos_id: int
    im_start_id: int
    im_end_id: int
    think_id: int
    think_end_id: int
    tool_call_id: int
    tool_call_end_id: int
    image_id: int | None
    harmony: bool
    kimi: bool
    turn_stop_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str: ...


class ByteTokenizer:
    """``vocab_size`` = 256 + len(SPECIAL_TOKENS) = 264; a ``Tokenizer``."""

    def __init__(self) -> None:
        self.special_ids: dict[str, int] = {t: 256 + i for i, t in enumerate(SPECIAL_TOKENS)}
        self.id_to_special: dict[int, str] = {i: t for t, i in self.special_ids.items()}
        self.vocab_size = 256 + len(SPECIAL_TOKENS)
        self.pad_id = self.eos_id = self.special_ids["<|endoftext|>"]
        self.image_id: int | None = self.special_ids["<image>"]
        self.im_start_id = self.special_ids["<|im_start|>"]
        self.im_end_id = self.special_ids["<|im_end|>"]
        self.think_id = self.special_ids["<think>"]
        self.think_end_id = self.special_ids["</think>"]
        self.tool_call_id = self.special_ids["<tool_call>"]
        self.tool_call_end_id = self.special_ids["</tool_call>"]
        self.harmony = self.kimi = False
        self.turn_stop_ids: tuple[int, ...] = ()

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
