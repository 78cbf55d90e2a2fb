"""Kimi's tokenizer files (tests/conftest.save_kimi_tokenizer: a tiny tiktoken.model trained in the test,
tokenizer_config.json with Kimi's added tokens, Kimi-style chat template) through HFTokenizer and
HFChatTemplate: ids equal a rank-by-rank tiktoken BPE, text never becomes a special id, and the
template renders a conversation as Kimi's published one does."""

from __future__ import annotations

import json

import pytest
import regex

from jointrl.envs.base import Message, ToolCall, ToolSpec
from jointrl.model.hf_chat_template import HFChatTemplate
from jointrl.model.hf_tokenizer import HFTokenizer, copy_tokenizer
from jointrl.model.kimi import KIMI_PATTERN, KIMI_TOKENS, NO_TOKEN, read_tiktoken_ranks
from jointrl.model.tokenizer import Tokenizer

TEXTS = ["Hello, world! 你好，世界！ HTTPResponse don't  x\n\n  y 12345",
         'Run {"name": "run_shell", "arguments": {"command": "ls -la /workspace"}} and wait.',
         "def main():\n    print('hello world')\n    return 0\n", "ÀÉÎ ñ café — naïve ✓ 🙂 カタカナ",
         "a <|im_end|> b <|tool_calls_section_begin|><|tool_call_begin|>functions.run:0 [EOS]"]


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory, kimi_files):
    save, _ = kimi_files
    return save(tmp_path_factory.mktemp("kimi_tok"))


@pytest.fixture(scope="module")
def kimi_tok(kimi_dir) -> HFTokenizer:
    return HFTokenizer(kimi_dir)


def _tiktoken_encode(text: str, ranks: dict[bytes, int]) -> list[int]:
    """tiktoken's algorithm, by the ranks: split by KIMI_PATTERN; a piece that is a token is that token,
    else merge its leftmost adjacent pair whose concatenation has the lowest rank until none is a token."""
    ids = []
    for piece in regex.findall(KIMI_PATTERN, text, flags=regex.V1):
        if piece.encode() in ranks:
            ids.append(ranks[piece.encode()])
            continue
        parts = [bytes([b]) for b in piece.encode()]
        while True:
            pairs = [(ranks.get(parts[i] + parts[i + 1]), i) for i in range(len(parts) - 1)]
            best = min(((r, i) for r, i in pairs if r is not None), default=None)
            if best is None:
                break
            parts[best[1]: best[1] + 2] = [parts[best[1]] + parts[best[1] + 1]]
        ids += [ranks[p] for p in parts]
    return ids


# Each token after the bytes joins two earlier ones (a BPE-trained order); most also split other ways
# into earlier tokens (abc = ab+c = a+bc, abca = abc+a = ab+ca = a+bca, ...), and "bc" ranks before "ab",
# so the merge list's order within one merged token (by the parts' ranks) is exercised.
TIED = [b"bc", b"ab", b"ca", b"abc", b"bca", b"cab", b"abca", b"aa", b"bcab", b"cabc", b"abcab", b"aab", b"caa",
        b"bcabc", b"abcabc"]


def test_tokens_with_several_splits_encode_as_tiktoken(kimi_dir, tmp_path):
    """The merges list every split of a token (module docstring); a vocabulary where tokens split into
    existing tokens in two or three ways still encodes as the rank-by-rank reference, on every string
    of a, b, c up to length 7 and on spaced and longer random ones."""
    import base64
    import itertools
    import random

    ranks = {bytes([b]): b for b in range(256)} | {t: 256 + k for k, t in enumerate(TIED)}
    assert all(any(t[:k] in ranks and t[k:] in ranks and max(ranks[t[:k]], ranks[t[k:]]) < ranks[t]
                   for k in range(1, len(t))) for t in TIED)
    several = [t for t in TIED if sum(t[:k] in ranks and t[k:] in ranks for k in range(1, len(t))) > 1]
    assert len(several) >= 8, several
    config = json.loads((kimi_dir / "tokenizer_config.json").read_text())
    old_base = len(read_tiktoken_ranks(kimi_dir / "tiktoken.model"))
    config["added_tokens_decoder"] = {str(int(i) - old_base + len(ranks)): t
                                      for i, t in config["added_tokens_decoder"].items()}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    tok = HFTokenizer(tmp_path)
    rng = random.Random(0)
    texts = ["".join(p) for n in range(1, 8) for p in itertools.product("abc", repeat=n)]
    texts += ["".join(rng.choice("abc  ") for _ in range(rng.randint(8, 40))) for _ in range(200)]
    for text in texts:
        assert tok.encode(text) == _tiktoken_encode(text, ranks), text


def test_special_ids_sit_after_the_ranks(kimi_tok, kimi_dir, kimi_files, tmp_path):
    tok, (save, added) = kimi_tok, kimi_files
    base = len(read_tiktoken_ranks(kimi_dir / "tiktoken.model"))
    for offset, (text, _) in added.items():
        assert tok.special_ids[text] == base + offset, text
    assert tok.special_ids["<|reserved_token_%d|>" % (base + 5)] == base + 5
    assert tok.vocab_size == base + 256 and isinstance(tok, Tokenizer)
    assert tok.kimi and not tok.harmony and tok.turn_stop_ids == ()
    assert (tok.eos_id, tok.im_end_id, tok.pad_id) == (base + 1, base + 2, base + 255)
    assert (tok.im_start_id, tok.tool_call_id, tok.tool_call_end_id) == (base + 4, base + 11, base + 12)
    assert tok.think_id == tok.think_end_id == NO_TOKEN  # Kimi-Linear-Instruct has no <think>
    thinking = HFTokenizer(save(tmp_path / "thinking", think=True))
    assert (thinking.think_id, thinking.think_end_id) == (base + 22, base + 23)


def test_ids_equal_tiktoken_and_text_never_becomes_a_special_id(kimi_tok, kimi_dir):
    ranks = read_tiktoken_ranks(kimi_dir / "tiktoken.model")
    for text in TEXTS:
        ids = kimi_tok.encode(text)
        assert ids == _tiktoken_encode(text, ranks), text
        assert kimi_tok.decode(ids) == text
        assert not set(ids) & set(kimi_tok.special_ids.values())
    assert len(kimi_tok.encode(TEXTS[1])) < len(TEXTS[1].encode()) / 2  # the merges do merge
    sp = kimi_tok.special_ids
    assert kimi_tok.encode_with_specials("x<|im_end|><|tool_call_begin|>") == [
        *kimi_tok.encode("x"), sp["<|im_end|>"], sp["<|tool_call_begin|>"]]


def test_bad_directories_are_named(tmp_path, kimi_files):
    with pytest.raises(ValueError, match="no tokenizer.json .* nor tiktoken.model"):
        HFTokenizer(tmp_path)
    d = kimi_files[0](tmp_path / "k")
    config = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").unlink()
    with pytest.raises(ValueError, match="lacks tokenizer_config.json"):
        HFTokenizer(d)
    del config["added_tokens_decoder"][str(min(map(int, config["added_tokens_decoder"])) + 17)]  # <|im_middle|>
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"lacks the special token\(s\) \['<\|endoftext\|>'"):
        HFTokenizer(d)  # no <|im_middle|>: not Kimi's format, and not ChatML's either
    config["added_tokens_decoder"]["7"] = {"content": "<|im_middle|>", "special": True}
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="outside the 256 reserved"):
        HFTokenizer(d)
    (d / "tiktoken.model").write_text("not-base64!! 0\n")
    with pytest.raises(ValueError, match="line 1 is not 'base64-token rank'"):
        HFTokenizer(d)


def test_malformed_tokenizer_config_names_the_file_and_entry(tmp_path, kimi_files):
    d = kimi_files[0](tmp_path / "k")
    path = d / "tokenizer_config.json"
    config = json.loads(path.read_text())
    path.write_text(path.read_text()[:-2])  # truncated
    with pytest.raises(ValueError, match=r"tokenizer_config.json' is not valid JSON \(.* at line \d+ column \d+"):
        HFTokenizer(d)
    key = next(iter(config["added_tokens_decoder"]))
    bad = {**config, "added_tokens_decoder": {**config["added_tokens_decoder"], key: {"special": True}}}
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=rf"tokenizer_config.json' added_tokens_decoder\['{key}'\] .* needs a string "
                                         "'content'"):
        HFTokenizer(d)
    path.write_text(json.dumps({**config, "added_tokens_decoder": {"x1": {"content": "<|a|>"}}}))
    with pytest.raises(ValueError, match="added_tokens_decoder key 'x1' is not a token id"):
        HFTokenizer(d)


KIMI_TOOLS = [ToolSpec("run", "run a shell command", {"type": "object", "properties": {
    "command": {"type": "string"}}, "required": ["command"]})]
# Kimi's published template, written out by hand for this conversation.
EXPECTED = (
    '<|im_system|>tool_declare<|im_middle|>[{"type":"function","function":{"name":"run","description":'
    '"run a shell command","parameters":{"type":"object","properties":{"command":{"type":"string"}},'
    '"required":["command"]}}}]<|im_end|>'
    "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
    "<|im_user|>user<|im_middle|>List the files.<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|>On it.<|tool_calls_section_begin|>"
    '<|tool_call_begin|>functions.run:0<|tool_call_argument_begin|>{"command": "ls"}<|tool_call_end|>'
    '<|tool_call_begin|>functions.run:1<|tool_call_argument_begin|>{"command": "pwd"}<|tool_call_end|>'
    "<|tool_calls_section_end|><|im_end|>"
    "<|im_system|>run<|im_middle|>## Return of functions.run:0\na.txt\n<|im_end|><|im_end|>"
    "<|im_system|>tool<|im_middle|>## Return of functions.run:1\n/w<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|>There is a.txt.<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|>")
CONVERSATION = [
    Message(role="system", content="Be brief."), Message(role="user", content="List the files."),
    Message(role="assistant", content="On it.", tool_calls=[ToolCall("run", {"command": "ls"}, id="functions.run:0"),
                                                            ToolCall("run", {"command": "pwd"})]),
    Message(role="tool", content="a.txt\n<|im_end|>", name="run", tool_call_id="functions.run:0"),
    Message(role="tool", content="/w", tool_call_id="functions.run:1"),
    Message(role="assistant", reasoning="dropped: the template has no reasoning", content="There is a.txt.")]


def test_template_renders_kimis_format_and_markers_are_ids(kimi_tok):
    tpl = HFChatTemplate(kimi_tok)  # checks the prefix property at load
    assert not tpl.drops_reasoning
    ids = tpl.render(CONVERSATION, KIMI_TOOLS)
    assert kimi_tok.decode(ids) == EXPECTED
    sp = kimi_tok.special_ids
    for text in KIMI_TOKENS.values():
        assert sp[text] in ids, text
    assert ids.count(sp["<|im_end|>"]) == 7  # the tool result's "<|im_end|>" is text, not the id
    assert tpl.generation_prompt() == [sp["<|im_assistant|>"], *kimi_tok.encode("assistant"), sp["<|im_middle|>"]]
    default = kimi_tok.decode(tpl.render([Message(role="user", content="hi")]))
    assert default == ("<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI."
                       "<|im_end|>\n<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>")


def test_id_less_calls_are_numbered_across_the_conversation(kimi_tok):
    """Kimi's ids count every call of the conversation (Kimi-K2's ``functions.NAME:IDX``; vLLM's
    history count), so each ``## Return of`` line names one call: a second turn's first call is :2."""
    tpl = HFChatTemplate(kimi_tok)
    ls, pwd, cat = (ToolCall("run", {"command": c}) for c in ("ls", "pwd", "cat a"))
    turns = [Message(role="assistant", content="On it.", tool_calls=[ls, pwd]),
             Message(role="assistant", content="More.", tool_calls=[cat])]
    convo = [Message(role="user", content="List."), turns[0], Message(role="tool", content="a", name="run"),
             Message(role="tool", content="/w", name="run"), turns[1]]
    text = kimi_tok.decode(tpl.render(convo, add_generation_prompt=False))
    ids = [part.split("<|tool_call_argument_begin|>")[0] for part in text.split("<|tool_call_begin|>")[1:]]
    assert ids == ["functions.run:0", "functions.run:1", "functions.run:2"]
    second = tpl.assistant_turn(turns[1], calls_before=2)  # what a scripted policy writes on turn two
    assert "functions.run:2" in kimi_tok.decode(second) and "functions.run:0" not in kimi_tok.decode(second)
    assert tpl.render(convo, add_generation_prompt=False)[-len(second):] == second


def test_export_copies_kimis_files_and_they_load_alike(kimi_dir, kimi_tok, tmp_path):
    assert copy_tokenizer(kimi_dir, tmp_path) == ["tiktoken.model", "tokenizer_config.json"]
    copied = HFTokenizer(tmp_path)
    assert copied.special_ids == kimi_tok.special_ids and copied.hf.chat_template == kimi_tok.hf.chat_template
    assert copied.encode(TEXTS[0]) == kimi_tok.encode(TEXTS[0])
