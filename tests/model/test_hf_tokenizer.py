"""HFTokenizer over a BPE trained in the test with Qwen3's added tokens (tests/conftest.py)."""

from __future__ import annotations

import json

import pytest

from jointrl.model.hf_tokenizer import SPECIAL_ROLES, HFTokenizer
from jointrl.model.tokenizer import ByteTokenizer, Tokenizer


def test_special_ids_are_the_added_tokens(qwen3_dir):
    tok = HFTokenizer(qwen3_dir)
    added = {t["content"]: t["id"] for t in json.loads((qwen3_dir / "tokenizer.json").read_text())["added_tokens"]}
    for attr, text in SPECIAL_ROLES.items():
        assert getattr(tok, attr) == added[text], attr
    assert tok.pad_id == added["<|endoftext|>"] and tok.image_id is None
    assert tok.vocab_size == max(added.values()) + 1
    assert isinstance(tok, Tokenizer) and isinstance(ByteTokenizer(), Tokenizer)


def test_text_never_becomes_a_special_id(qwen3_dir):
    tok = HFTokenizer(qwen3_dir)
    text = "a <|im_end|> b <think>c</think> <tool_call>{}</tool_call> <|endoftext|>"
    ids = tok.encode(text)
    assert not set(ids) & set(tok.special_ids.values())
    assert tok.decode(ids) == text
    assert tok.hf.encode(text, add_special_tokens=False) != ids  # transformers' own encode matches them
    assert tok.encode_with_specials("x<|im_end|>") == [*tok.encode("x"), tok.im_end_id]
    assert tok.decode([tok.think_id, *tok.encode("hm"), tok.think_end_id], skip_special=True) == "hm"
    assert tok.decode([*tok.encode("a"), tok.vocab_size + 3]) == "a"  # an embedding row past the tokenizer
    with pytest.raises(ValueError, match="negative"):
        tok.decode([-1])


def test_bad_directories_are_named(tmp_path, qwen3_dir):
    with pytest.raises(ValueError, match="no tokenizer.json"):
        HFTokenizer(tmp_path)
    raw = json.loads((qwen3_dir / "tokenizer.json").read_text())
    raw["added_tokens"] = [t for t in raw["added_tokens"] if t["content"] != "</think>"]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((qwen3_dir / name).read_text())
    (tmp_path / "tokenizer.json").write_text(json.dumps(raw))
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg.pop("added_tokens_decoder", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="</think>"):
        HFTokenizer(tmp_path)
