"""Kimi's tokenizer files (Moonshot AI: Kimi-K2, Kimi-Linear) as a fast tokenizer, with no remote code
and no ``tiktoken`` package.

What a Kimi checkpoint ships instead of ``tokenizer.json``: ``tiktoken.model`` (one line per token:
its bytes in base64, a space, its rank; ranks 0..N-1 are the ids and the BPE merge order),
``tokenizer_config.json`` (``added_tokens_decoder``: the special tokens at ids N.., ``bos_token``,
``eos_token``, ``pad_token``, and the ``chat_template``, or a ``chat_template.jinja`` beside it) and
``tokenization_kimi.py`` (remote code over ``tiktoken``; not run here). That code reserves
``NUM_RESERVED`` = 256 special ids after the N ranks, named by ``added_tokens_decoder`` or else
``<|reserved_token_{id}|>``, and splits text with ``KIMI_PATTERN`` before the byte-level BPE.

``tiktoken_tokenizer(directory)`` rebuilds that as a ``tokenizers`` BPE: vocabulary = the ranks
(bytes through GPT-2's byte -> character map), merges = every split of a token into two tokens,
ordered by the merged token's rank, then by the parts' ranks (tiktoken merges the leftmost adjacent
pair whose concatenation has the lowest rank; ``ignore_merges`` takes a whole pre-token that is itself
a token, as tiktoken does), pre-tokenizer = ``KIMI_PATTERN`` (oniguruma accepts its ``&&`` class
intersections) then ByteLevel without its own regex. That the merge order equals tiktoken's rule is
checked, not proven: the ids equal the rank-by-rank reference on a trained 300-merge vocabulary and on
one whose tokens split two or three ways into earlier tokens, where reversing the order among a
token's splits gives the same ids too (tests/model/test_kimi.py). Transformers 5.24's ``TikTokenConverter`` does the same conversion but reads
the file through the ``tiktoken`` package and uses its default (GPT-4) pattern unless told; the
file format is four lines of Python, so we read it ourselves (tests/model/test_kimi.py).

The chat format (the checkpoint's own Jinja, rendered by ``model/hf_chat_template.HFChatTemplate``)::

    <|im_system|>tool_declare<|im_middle|>{tools JSON}<|im_end|>         (with tools)
    <|im_system|>system<|im_middle|>{system}<|im_end|>
    <|im_user|>user<|im_middle|>{user}<|im_end|>
    <|im_assistant|>assistant<|im_middle|>{content}<|tool_calls_section_begin|>
        <|tool_call_begin|>functions.{name}:{index}<|tool_call_argument_begin|>{JSON}<|tool_call_end|> ...
        <|tool_calls_section_end|><|im_end|>
    <|im_system|>{name or 'tool'}<|im_middle|>## Return of {tool_call_id}\\n{result}<|im_end|>

The section, call and argument markers are added tokens (flagged not special in Kimi's config, like
Qwen3's ``<tool_call>``): ``rl/parser.parse_kimi_turn`` reads them by id. ``KIMI_ROLES`` are the
loop's roles (``model/tokenizer.Tokenizer``) played by Kimi's tokens; a vocabulary with
``<think>`` / ``</think>`` (Kimi-K2-Thinking) reasons between them, one without (Kimi-Linear-
Instruct, Kimi-K2-Instruct) has ``think_id = think_end_id = NO_TOKEN``, an id no engine samples.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

# tokenization_kimi.py's pat_str (the same for Kimi-K2 and Kimi-Linear).
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
NUM_RESERVED = 256  # special ids after the ranks (tokenization_kimi.py's num_reserved_special_tokens)
NO_TOKEN = -1  # think_id / think_end_id of a vocabulary without <think>: never sampled, never in a prompt

# Token attribute -> Kimi token string (rl/parser.parse_kimi_turn reads them by id).
KIMI_TOKENS: dict[str, str] = {
    "im_user_id": "<|im_user|>", "im_assistant_id": "<|im_assistant|>", "im_system_id": "<|im_system|>",
    "im_middle_id": "<|im_middle|>", "section_id": "<|tool_calls_section_begin|>",
    "section_end_id": "<|tool_calls_section_end|>", "call_id": "<|tool_call_begin|>",
    "argument_id": "<|tool_call_argument_begin|>", "call_end_id": "<|tool_call_end|>",
}
# The loop's roles played by Kimi's tokens (think_id / think_end_id: <think> / </think> when present).
KIMI_ROLES: dict[str, str] = {
    "eos_id": "[EOS]", "im_start_id": "<|im_assistant|>", "im_end_id": "<|im_end|>",
    "tool_call_id": "<|tool_calls_section_begin|>", "tool_call_end_id": "<|tool_calls_section_end|>",
}
KIMI_THINK = ("<think>", "</think>")


def read_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """A ``tiktoken.model`` file -> {token bytes: rank}; ValueError naming the file and line if a line
    is not ``base64 rank`` or the ranks are not 0..N-1."""
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as e:
            raise ValueError(f"tokenizer: {str(path)!r} line {n} is not 'base64-token rank' ({e})") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"tokenizer: {str(path)!r} ranks are not 0..{len(ranks) - 1}, each once")
    return ranks


def vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The BPE vocabulary (byte-level strings -> rank) and merges (module docstring) of ``ranks``."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    char = bytes_to_unicode()  # GPT-2's byte -> printable character map (what ByteLevel emits)

    def text(b: bytes) -> str:
        return "".join(char[x] for x in b)

    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for k in range(1, len(token)):
            left, right = token[:k], token[k:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort()
    return {text(t): r for t, r in ranks.items()}, [(text(a), text(b)) for *_, a, b in merges]


def _read_config(path: Path) -> dict:
    """``tokenizer_config.json`` as a dict; ValueError naming the file if it is not a JSON object."""
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"tokenizer: {str(path)!r} is not valid JSON ({e.msg} at line {e.lineno} "
                         f"column {e.colno})") from None
    if not isinstance(config, dict):
        raise ValueError(f"tokenizer: {str(path)!r} must be a JSON object, got {type(config).__name__}")
    return config


def _added_tokens(config: dict, path: Path) -> dict[int, dict]:
    """``added_tokens_decoder`` as {id: entry}; ValueError naming the file and entry if an id is not an
    integer or an entry is not an object with a string ``content``."""
    decoder = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        raise ValueError(f"tokenizer: {str(path)!r} added_tokens_decoder must be an object {{id: {{content, ...}}}}, "
                         f"got {type(decoder).__name__}")
    added = {}
    for key, entry in decoder.items():
        if not str(key).isdigit():
            raise ValueError(f"tokenizer: {str(path)!r} added_tokens_decoder key {key!r} is not a token id")
        if not isinstance(entry, dict) or not isinstance(entry.get("content"), str):
            raise ValueError(f"tokenizer: {str(path)!r} added_tokens_decoder[{key!r}] = {entry!r:.120} needs a "
                             "string 'content'")
        added[int(key)] = entry
    return added


def tiktoken_tokenizer(directory: str | Path) -> Any:
    """``directory``'s ``tiktoken.model`` + ``tokenizer_config.json`` (+ ``chat_template.jinja``) as a
    ``PreTrainedTokenizerFast`` (module docstring); ValueError naming a missing or malformed piece."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    src = Path(directory)
    missing = [name for name in ("tiktoken.model", "tokenizer_config.json") if not (src / name).is_file()]
    if missing:
        raise ValueError(f"tokenizer: {str(src)!r} lacks {' and '.join(missing)} (a tiktoken tokenizer needs "
                         "tiktoken.model and tokenizer_config.json with its added_tokens_decoder)")
    ranks = read_tiktoken_ranks(src / "tiktoken.model")
    config = _read_config(src / "tokenizer_config.json")
    added = _added_tokens(config, src / "tokenizer_config.json")
    base = len(ranks)
    outside = sorted(i for i in added if not base <= i < base + NUM_RESERVED)
    if outside:
        raise ValueError(f"tokenizer: {str(src)!r} tokenizer_config.json names added tokens at ids {outside[:4]}, "
                         f"outside the {NUM_RESERVED} reserved after the {base} ranks")
    vocab, merges = vocab_and_merges(ranks)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(KIMI_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    specials = []
    for i in range(base, base + NUM_RESERVED):
        t = added.get(i, {"content": f"<|reserved_token_{i}|>", "special": True})
        specials.append(AddedToken(t["content"], special=t.get("special", True), normalized=False,
                                   lstrip=t.get("lstrip", False), rstrip=t.get("rstrip", False)))
    tok.add_tokens(specials)  # ids base.. in order: the vocabulary ends at base - 1
    assert tok.token_to_id(specials[-1].content) == base + NUM_RESERVED - 1, "reserved ids out of place"
    template = config.get("chat_template")
    if (src / "chat_template.jinja").is_file():
        template = (src / "chat_template.jinja").read_text()

    def token(key: str) -> str | None:
        value = config.get(key)
        return value.get("content") if isinstance(value, dict) else value

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=token("bos_token"), eos_token=token("eos_token"),
                                   pad_token=token("pad_token"), unk_token=token("unk_token"),
                                   model_max_length=config.get("model_max_length", 1 << 20))
    fast.chat_template = template
    return fast
