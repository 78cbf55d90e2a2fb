"""Every Triton kernel compiles for Hopper (sm_90) with the tile sizes and dtypes its launcher
uses in production. No GPU needed: ``triton.compile`` to a cubin. The interpreter accepts
shapes the compiler rejects (e.g. an 8x8 ``tl.dot``), so these complement the interpreter tests.
"""

from __future__ import annotations

import pytest
import torch

from jointrl.kernels import dsa, kda, moe_matmul, mxfp4, paged_attention, topk


def _has_sass_or_ptx(compiled) -> bool:
    return "cubin" in compiled.asm and len(compiled.asm["cubin"]) > 0


@pytest.mark.parametrize(("dtype", "rule"), [(torch.bfloat16, "floor"), (torch.float32, "ceil"),
                                             (torch.float16, "floor")])
def test_quantize_mxfp4_compiles(sm90, dtype, rule):
    bf16 = dtype == torch.bfloat16
    c = sm90(mxfp4._quantize_mxfp4_kernel,
             {"x_ptr": torch.int16 if bf16 else dtype, "blocks_ptr": torch.uint8, "scales_ptr": torch.uint8,
              "n_rows": "i32"},
             {"CEIL": rule == "ceil", "BF16_BITS": bf16, "BLOCK_ROWS": mxfp4.QUANT_BLOCK_ROWS})
    assert _has_sass_or_ptx(c)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantize_mxfp4_compiles(sm90, dtype):
    bf16 = dtype == torch.bfloat16
    c = sm90(mxfp4._dequantize_mxfp4_kernel,
             {"blocks_ptr": torch.uint8, "scales_ptr": torch.uint8, "out_ptr": torch.int16 if bf16 else dtype,
              "n_rows": "i32"},
             {"BF16_BITS": bf16, "BLOCK_ROWS": mxfp4.DEQUANT_BLOCK_ROWS})
    assert _has_sass_or_ptx(c)


@pytest.mark.parametrize(("config", "dtype"), [(moe_matmul.DECODE, torch.bfloat16), (moe_matmul.PREFILL, torch.bfloat16),
                                               (moe_matmul.DECODE, torch.float32)], ids=["decode", "prefill", "fp32"])
@pytest.mark.parametrize("which", ["swiglu", "down"])
@pytest.mark.parametrize("mxfp4", [True, False], ids=["mxfp4", "dense"])
def test_moe_matmul_compiles(sm90, config, dtype, which, mxfp4):
    w = torch.uint8 if mxfp4 else dtype  # dense experts: the weights in the activations' dtype
    common = {"tile_expert_ptr": torch.int32, "tile_row_ptr": torch.int32, "offsets_ptr": torch.int32,
              "wb_ptr": w, "ws_ptr": w, "H": "i32", "I": "i32"}
    if which == "swiglu":
        kernel, args = moe_matmul._moe_swiglu_kernel, {"x_ptr": dtype, "h_ptr": dtype, **common}
    else:
        kernel, args = moe_matmul._moe_down_kernel, {"h_ptr": dtype, "w_ptr": dtype, "y_ptr": dtype, **common}
    c = sm90(kernel, args,
             {"BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "BLOCK_K": config.block_k,
              "DOT_FP32": dtype == torch.float32, "MXFP4": mxfp4},
             num_warps=config.num_warps, num_stages=config.num_stages)
    assert _has_sass_or_ptx(c)
    assert c.metadata.shared <= 228 * 1024  # fits an H100/H200 SM's shared memory


def _paged_args(dtype):
    return {"q_ptr": dtype, "k_ptr": dtype, "v_ptr": dtype, "table_ptr": torch.int32, "ctx_ptr": torch.int32,
            "o_ptr": dtype, "sinks_ptr": torch.float32, "qk_scale": "fp32", "G": "i32", "D": "i32",
            "block_size": "i32", "window": "i32",
            **{name: "i32" for name in ("stride_qb", "stride_qh", "stride_kb", "stride_ks", "stride_kh",
                                        "stride_vb", "stride_vs", "stride_vh", "stride_tb", "stride_ob", "stride_oh")}}


@pytest.mark.parametrize(("hq", "hkv", "d", "dtype", "sinks", "window"), [
    (32, 8, 128, torch.bfloat16, False, False), (64, 4, 128, torch.bfloat16, False, False),
    (16, 16, 64, torch.float32, False, False),
    (64, 8, 64, torch.bfloat16, True, True),  # gpt-oss's attention (sinks, a sliding layer)
    (64, 8, 64, torch.bfloat16, True, False),  # gpt-oss's full layers
])
def test_paged_decode_compiles(sm90, hq, hkv, d, dtype, sinks, window):
    cfg = paged_attention.DECODE_CONFIG
    block_g, block_d = paged_attention.decode_tiles(hq, hkv, d)
    c = sm90(paged_attention._paged_decode_kernel, _paged_args(dtype),
             {"BLOCK_G": block_g, "BLOCK_D": block_d, "BLOCK_N": cfg.block_n, "DOT_FP32": dtype == torch.float32,
              "SINKS": sinks, "WINDOW": window},
             num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    assert _has_sass_or_ptx(c)


@pytest.mark.parametrize(("hq", "hkv", "d", "dtype", "kv_dtype", "chunks", "sinks", "window"), [
    (32, 4, 128, torch.bfloat16, torch.bfloat16, 8, False, False),  # Qwen3-30B-A3B's attention
    (64, 4, 128, torch.bfloat16, torch.bfloat16, 100, False, False),
    (16, 16, 64, torch.float32, torch.bfloat16, 1, False, False),  # a float32 model over a bfloat16 pool
    (64, 8, 64, torch.bfloat16, torch.bfloat16, 8, True, True),  # gpt-oss: sinks, a sliding layer
    (64, 8, 64, torch.bfloat16, torch.bfloat16, 8, True, False),  # gpt-oss's full layers
])
def test_paged_prefill_compiles(sm90, hq, hkv, d, dtype, kv_dtype, chunks, sinks, window):
    cfg = paged_attention.PREFILL_CONFIG
    block_c, block_d = paged_attention.prefill_tiles(chunks, d)
    c = sm90(paged_attention._paged_prefill_kernel,
             {"q_ptr": dtype, "kv_ptr": kv_dtype, "slots_ptr": torch.int64, "start_ptr": torch.int64,
              "row0_ptr": torch.int64, "count_ptr": torch.int64, "o_ptr": dtype, "sinks_ptr": torch.float32,
              "qk_scale": "fp32", "C": "i32", "G": "i32", "D": "i32", "window": "i32",
              **{name: "i32" for name in ("stride_qn", "stride_qh", "stride_kvp", "stride_kvc", "stride_kvh",
                                          "stride_sc", "stride_on", "stride_oh")}},
             {"BLOCK_C": block_c, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_D": block_d,
              "DOT_FP32": dtype == torch.float32, "SINKS": sinks, "WINDOW": window},
             num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    assert _has_sass_or_ptx(c)
    assert c.metadata.shared <= 228 * 1024

@pytest.mark.parametrize(("dtype", "has_state"), [(torch.bfloat16, True), (torch.float32, False)])
def test_kda_recurrent_compiles(sm90, dtype, has_state):
    cfg = kda.RECURRENT_CONFIG
    c = sm90(kda._kda_recurrent_kernel,
             {"q_ptr": dtype, "k_ptr": dtype, "v_ptr": dtype, "g_ptr": dtype, "beta_ptr": dtype,
              "s0_ptr": torch.float32, "o_ptr": torch.float32, "s_ptr": torch.float32,
              "T": "i32", "N": "i32", "K": "i32", "V": "i32", "scale": "fp32"},
             {"HAS_STATE": has_state, "BLOCK_K": 128, "BLOCK_V": cfg.block_v}, num_warps=cfg.num_warps)
    assert _has_sass_or_ptx(c)


def _kda_chunk_args(dtype, *names):
    """The chunk kernels' runtime arguments: q, k, v, beta in ``dtype`` (the model's), g and
    everything the launchers allocate in fp32."""
    args = {name: torch.float32 for name in names}
    args.update({"q_ptr": dtype, "k_ptr": dtype, "v_ptr": dtype, "g_ptr": torch.float32, "beta_ptr": dtype,
                 "T": "i32", "N": "i32", "K": "i32", "V": "i32", "scale": "fp32"})
    return args


@pytest.mark.parametrize("states_only", [False, True], ids=["forward", "backward-recompute"])
def test_kda_chunk_forward_compiles(sm90, states_only):
    cfg = kda.CHUNK_CONFIG
    c = sm90(kda._kda_chunk_fwd_kernel, _kda_chunk_args(torch.bfloat16, "s0_ptr", "o_ptr", "s_ptr", "h_ptr"),
             {"HAS_STATE": True, "STATES_ONLY": states_only, "CHUNK": cfg.chunk, "BLOCK_K": 128,
              "BLOCK_V": cfg.block_v}, num_warps=cfg.num_warps)
    assert _has_sass_or_ptx(c)


def test_kda_chunk_backward_compiles(sm90):
    cfg = kda.CHUNK_BWD_CONFIG
    names = ("h_ptr", "do_ptr", "dst_ptr", "dq_ptr", "dk_ptr", "dv_ptr", "dg_ptr", "dbeta_ptr", "ds0_ptr")
    c = sm90(kda._kda_chunk_bwd_kernel, _kda_chunk_args(torch.bfloat16, *names),
             {"CHUNK": kda.CHUNK_CONFIG.chunk, "BLOCK_K": 128, "BLOCK_V": cfg.block_v}, num_warps=cfg.num_warps)
    assert _has_sass_or_ptx(c)
    assert c.metadata.shared <= 228 * 1024


def test_topk_compiles(sm90):
    cfg = topk.TOPK_CONFIG
    c = sm90(topk._topk_kernel, {"scores_ptr": torch.float32, "visible_ptr": torch.uint8, "ids_ptr": torch.int32,
                                 "S": "i32", "TOPK": "i32"},
             {"BLOCK_S": topk._block_s(4096)}, num_warps=cfg.num_warps)  # 1024-key blocks
    assert _has_sass_or_ptx(c)


def test_dsa_indexer_compiles(sm90):
    cfg = dsa.INDEXER_CONFIG
    c = sm90(dsa._indexer_kernel,
             {"q_ptr": torch.bfloat16, "w_ptr": torch.bfloat16, "k_ptr": torch.bfloat16, "out_ptr": torch.float32,
              "T": "i32", "S": "i32", "NH": "i32", "Di": "i32", "scale": "fp32"},
             {"BLOCK_T": cfg.block_t, "BLOCK_S": cfg.block_s, "BLOCK_D": 128, "DOT_FP32": False},
             num_warps=cfg.num_warps)
    assert _has_sass_or_ptx(c)


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_dsa_sparse_attention_compiles(sm90, direction):
    cfg = dsa.SPARSE_CONFIG
    block_g, block_d = dsa._tiles_gd(32, 4, 128)
    bf16 = torch.bfloat16
    args = {"q_ptr": bf16, "k_ptr": bf16, "v_ptr": bf16, "ids_ptr": torch.int32, "o_ptr": bf16,
            "T": "i32", "S": "i32", "Hq": "i32", "Hkv": "i32", "D": "i32", "NK": "i32", "scale": "fp32"}
    if direction == "fwd":
        kernel, args = dsa._sparse_fwd_kernel, {**args, "lse_ptr": torch.float32}
    else:
        kernel = dsa._sparse_bwd_kernel
        args = {**args, "do_ptr": bf16, "lse_ptr": torch.float32, "dq_ptr": bf16, "dk_ptr": torch.float32,
                "dv_ptr": torch.float32}
    c = sm90(kernel, args, {"BLOCK_G": block_g, "BLOCK_D": block_d, "BLOCK_N": cfg.block_n, "DOT_FP32": False},
             num_warps=cfg.num_warps)
    assert _has_sass_or_ptx(c)


def test_compiler_rejects_what_the_interpreter_accepts(sm90):
    # Why these tests exist: a dot over an 8-wide head_dim runs in the interpreter, not on sm_90.
    with pytest.raises(Exception, match="(?i)dot|shape|size|16"):
        sm90(paged_attention._paged_decode_kernel, _paged_args(torch.bfloat16),
             {"BLOCK_G": 16, "BLOCK_D": 8, "BLOCK_N": 16, "DOT_FP32": False, "SINKS": False, "WINDOW": False})
