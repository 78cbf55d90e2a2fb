import os

import torch

if not torch.cuda.is_available():  # a GPU run leaves DeepSpeed's accelerator to each rank's device (rl/device.py)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("WANDB_SILENT", "true")

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

QWEN3_TEMPLATE = Path(__file__).parent / "assets" / "qwen3_chat_template.jinja"
# Qwen3's added tokens in its order; like Qwen3, <think> / <tool_call> / <tool_response> are not
# flagged special (their strings in text are still matched by transformers' own encode).
QWEN3_ADDED = (("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
               ("<tool_call>", False), ("</tool_call>", False), ("<tool_response>", False),
               ("</tool_response>", False), ("<think>", False), ("</think>", False))
_CORPUS = [
    "The user asks for the file list; I should call the shell tool and read its output.",
    'Run {"name": "run_shell", "arguments": {"command": "ls -la /workspace"}} and wait.',
    "def main():\n    print('hello world')\n    return 0\n",
    "Reasoning: the tests fail because the function was renamed; rename it back and rerun.",
    "Answer: 42. The total of the ledger is computed from the rows of the table.",
    "<tool_response>\nfile.txt\nmain.py\n</tool_response> Thanks, that looks right.",
]


def _trained_bpe(merges: int):
    """A byte-level BPE trained here on ``_CORPUS`` (~``merges`` merges after the 256 bytes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=256 + merges, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    return tok


def _save_fast(tok, directory: Path, added, eos: str, pad: str, chat_template: str | None = None) -> Path:
    """``tok`` with ``added`` ((string, special) pairs) appended, saved as a fast tokenizer."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    tok.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in added])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=pad, model_max_length=1 << 17)
    fast.chat_template = chat_template
    fast.save_pretrained(str(directory))
    return directory


def save_qwen3_tokenizer(directory: Path, merges: int = 300) -> Path:
    """A byte-level BPE trained here on a small corpus (~``merges`` merges) with Qwen3's added
    tokens appended after the base vocabulary and a Qwen3-style chat template
    (``assets/qwen3_chat_template.jinja``), saved as a fast tokenizer."""
    return _save_fast(_trained_bpe(merges), directory, QWEN3_ADDED, "<|im_end|>", "<|endoftext|>",
                      QWEN3_TEMPLATE.read_text())


def save_qwen3_moe(directory: Path, vocab_size: int, seed: int = 0, **shape) -> Path:
    """A random ``Qwen3MoeForCausalLM`` (transformers' class) saved with ``save_pretrained``; q/k-norm
    and router weights randomised so they matter. ``shape`` overrides the tiny default."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    kw = dict(vocab_size=vocab_size, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=64, intermediate_size=64, moe_intermediate_size=32,
              num_experts=4, num_experts_per_tok=2, max_position_embeddings=4096, tie_word_embeddings=False,
              pad_token_id=None, bos_token_id=None, eos_token_id=None)
    max_shard_size = shape.pop("max_shard_size", "5GB")
    kw.update(shape)
    torch.manual_seed(seed)
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(**kw)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    hf.save_pretrained(str(directory), max_shard_size=max_shard_size)
    return directory


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen3-MoE (head_dim 64) with a BPE tokenizer and Qwen3-style chat template."""
    d = save_qwen3_tokenizer(tmp_path_factory.mktemp("qwen3"))
    vocab = len(json.loads((d / "tokenizer.json").read_text())["model"]["vocab"]) + len(QWEN3_ADDED)
    return save_qwen3_moe(d, vocab_size=(vocab + 63) // 64 * 64)


@pytest.fixture(scope="session")
def qwen3_files():
    """(save_qwen3_tokenizer, save_qwen3_moe): for tests that need their own directory."""
    return save_qwen3_tokenizer, save_qwen3_moe


def save_gpt_oss_moe(directory: Path, vocab_size: int, seed: int = 0, **shape) -> Path:
    """A random ``GptOssForCausalLM`` (transformers' class; sliding window 4, YaRN RoPE) saved with
    ``save_pretrained``, then its experts rewritten as the hub's MXFP4 ``_blocks`` + ``_scales`` by our
    quantizer (``kernels/mxfp4``, floor rule) with the hub's ``quantization_config``. Biases, sinks and
    expert weights are drawn large enough that each matters."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import GptOssConfig, GptOssForCausalLM

    from jointrl.kernels.mxfp4 import quantize_mxfp4
    from jointrl.model.hf_gpt_oss import quantization_config

    kw = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
              max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=None, bos_token_id=None,
              eos_token_id=None, rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                                  "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                  "original_max_position_embeddings": 64})
    kw.update(shape)
    torch.manual_seed(seed)
    hf = GptOssForCausalLM(GptOssConfig(**kw)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.normal_(0.0, 0.5)
            elif ".experts." in name:
                p.normal_(0.0, 0.3)
    hf.save_pretrained(str(directory))
    state = load_file(directory / "model.safetensors")
    for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(state.pop(key).transpose(1, 2).contiguous())  # [E, out, in] along in
        state[f"{key}_blocks"], state[f"{key}_scales"] = blocks.unflatten(-1, (-1, 16)), scales
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = quantization_config()
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


# o200k_harmony's special tokens that harmony uses (gpt-oss's tokenizer.json flags them all special).
HARMONY_ADDED = ("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>",
                 "<|end|>", "<|message|>", "<|call|>")


def save_harmony_tokenizer(directory: Path, merges: int = 300) -> Path:
    """A byte-level BPE trained here (as ``save_qwen3_tokenizer``) with harmony's special tokens added,
    saved as a fast tokenizer without a chat template (harmony is rendered by model/harmony.py)."""
    return _save_fast(_trained_bpe(merges), directory, [(t, True) for t in HARMONY_ADDED], "<|return|>",
                      "<|endoftext|>")


KIMI_TEMPLATE = Path(__file__).parent / "assets" / "kimi_chat_template.jinja"
# Kimi-K2's / Kimi-Linear's added tokens as offsets from the first id after the ranks (163584 there),
# with their "special" flags; the tool-call markers are flagged not special, as in Kimi's config.
KIMI_ADDED = {0: ("[BOS]", True), 1: ("[EOS]", True), 2: ("<|im_end|>", True), 3: ("<|im_user|>", True),
              4: ("<|im_assistant|>", True), 6: ("<|start_header_id|>", True), 7: ("<|end_header_id|>", True),
              9: ("[EOT]", True), 10: ("<|im_system|>", True), 11: ("<|tool_calls_section_begin|>", False),
              12: ("<|tool_calls_section_end|>", False), 13: ("<|tool_call_begin|>", False),
              14: ("<|tool_call_argument_begin|>", False), 15: ("<|tool_call_end|>", False),
              17: ("<|im_middle|>", True), 254: ("[UNK]", True), 255: ("[PAD]", True)}
KIMI_THINK_ADDED = {22: ("<think>", False), 23: ("</think>", False)}  # Kimi-K2-Thinking's


def save_kimi_tokenizer(directory: Path, merges: int = 300, think: bool = False) -> Path:
    """Kimi's tokenizer files, tiny: ``tiktoken.model`` (the ranks of a BPE trained here, as
    ``save_qwen3_tokenizer``'s: base64 bytes and rank per line), ``tokenizer_config.json`` with
    Kimi's added tokens at their offsets after the ranks (``think``: also ``<think>`` / ``</think>``)
    and a Kimi-style chat template (``assets/kimi_chat_template.jinja``). No ``tokenizer.json``."""
    import base64

    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    vocab = _trained_bpe(merges).get_vocab()  # ids: the 256 bytes, then the merges in order
    ranks = sorted(vocab.items(), key=lambda kv: kv[1])
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tiktoken.model").write_text("".join(
        f"{base64.b64encode(bytes(byte_of[c] for c in token)).decode()} {rank}\n" for token, rank in ranks))
    added = {**KIMI_ADDED, **(KIMI_THINK_ADDED if think else {})}
    config = {
        "added_tokens_decoder": {str(len(ranks) + k): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                                       "single_word": False, "special": special}
                                 for k, (t, special) in sorted(added.items())},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "chat_template": KIMI_TEMPLATE.read_text(), "model_max_length": 1048576,
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return directory


@pytest.fixture(scope="session")
def kimi_files():
    """(save_kimi_tokenizer, KIMI_ADDED): for tests that need their own directory."""
    return save_kimi_tokenizer, KIMI_ADDED


@pytest.fixture(scope="session")
def gpt_oss_dir(tmp_path_factory) -> Path:
    """A tiny random gpt-oss (MXFP4 experts, sliding window 4) with a harmony BPE tokenizer."""
    d = save_harmony_tokenizer(tmp_path_factory.mktemp("gpt_oss"))
    vocab = len(json.loads((d / "tokenizer.json").read_text())["model"]["vocab"]) + len(HARMONY_ADDED)
    return save_gpt_oss_moe(d, vocab_size=(vocab + 63) // 64 * 64)


def run_interpreted(path: Path, marker: str = "not slow") -> str:
    """``pytest -m marker path`` in a child process with ``TRITON_INTERPRET=1`` (the variable must be set before
    triton is imported, and would turn every kernel of this process into an interpreted one): the folders
    ``tests/*/interpreted/``. Fails with the child's output unless it passed; returns its stdout."""
    import subprocess  # only the interpreted runners start a child pytest
    import sys  # as above

    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore::RuntimeWarning",
         "-m", marker, str(path)],
        cwd=Path(__file__).parents[1], env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
        timeout=540,
    )
    assert proc.returncode == 0, f"interpreted tests failed ({path}):\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="session")
def interpreted():
    """``run_interpreted`` for the ``test_interpreted.py`` runners."""
    return run_interpreted


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.gpu`` tests are skipped, with the reason, where CUDA is not available."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: no GPU visible to torch here (tests/gpu/check.sh runs them on one)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
