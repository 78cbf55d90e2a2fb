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


def save_qwen3_tokenizer(directory: Path, merges: int = 300) -> Path:
    """A byte-level BPE trained here on a small corpus (~``merges`` merges) with Qwen3's added
    tokens appended after the base vocabulary and a Qwen3-style chat template
    (``assets/qwen3_chat_template.jinja``), saved as a fast tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=256 + merges, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in QWEN3_ADDED])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   model_max_length=1 << 17)
    fast.chat_template = QWEN3_TEMPLATE.read_text()
    fast.save_pretrained(str(directory))
    return directory


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
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=256 + merges, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in HARMONY_ADDED])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|return|>", pad_token="<|endoftext|>",
                                   model_max_length=1 << 17)
    fast.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="session")
def gpt_oss_dir(tmp_path_factory) -> Path:
    """A tiny random gpt-oss (MXFP4 experts, sliding window 4) with a harmony BPE tokenizer."""
    d = save_harmony_tokenizer(tmp_path_factory.mktemp("gpt_oss"))
    vocab = len(json.loads((d / "tokenizer.json").read_text())["model"]["vocab"]) + len(HARMONY_ADDED)
    return save_gpt_oss_moe(d, vocab_size=(vocab + 63) // 64 * 64)


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.gpu`` tests are skipped, with the reason, where CUDA is not available."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: no GPU visible to torch here (tests/gpu/check.sh runs them on one)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
