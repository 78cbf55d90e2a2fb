"""Weight push: what lands on the receiver, bucket bounds, and every refusal path."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch
from torch import nn

from jointrl.kernels.mxfp4 import mxfp4_roundtrip
from jointrl.rl.weight_sync import (
    EntryKind,
    WeightBundle,
    apply_bucket,
    apply_bundle,
    build_bundle,
    is_routed_expert,
    iter_buckets,
)

H, I, E, V = 64, 32, 4, 256
EXPERT_NAMES = [f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")]


class _Experts(nn.Module):
    def __init__(self, inter: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * inter, H))  # [E, 2I, H]
        self.down_proj = nn.Parameter(torch.randn(E, H, inter))  # [E, H, I]


class _Layer(nn.Module):
    def __init__(self, inter: int):
        super().__init__()
        self.input_layernorm = nn.Module()
        self.input_layernorm.weight = nn.Parameter(torch.randn(H))
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(H, H, bias=False)
        self.self_attn.k_proj = nn.Linear(H, H, bias=False)
        self.self_attn.register_buffer("inv_freq", torch.rand(H // 2))
        self.mlp = nn.Module()
        self.mlp.gate = nn.Linear(H, E, bias=False)  # router: stays dense
        self.mlp.experts = _Experts(inter)


class TinyMoE(nn.Module):
    """Parameter names as in the MoE model: model.layers.N.{self_attn,mlp.experts}...."""

    def __init__(self, seed: int, dtype: torch.dtype = torch.float32, inter: int = I):
        super().__init__()
        torch.manual_seed(seed)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(V, H)
        self.model.layers = nn.ModuleList([_Layer(inter) for _ in range(2)])
        self.lm_head = nn.Linear(H, V, bias=False)
        self.to(dtype)


def _snapshot(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _assert_unchanged(m: nn.Module, before: dict[str, torch.Tensor]) -> None:
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("rule", ["floor", "ceil"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_lands_dense_bit_exact_and_experts_as_mxfp4_roundtrip(dtype, rule):
    src, dst = TinyMoE(0, dtype), TinyMoE(1, dtype)
    bundle = build_bundle(src.state_dict(), version=3, is_quantized=is_routed_expert, scale_rule=rule)
    apply_bundle(dst, bundle, expected_version=3)

    got, want = dst.state_dict(), src.state_dict()
    assert set(got) == set(want)
    for name, t in want.items():
        assert got[name].dtype == dtype or name.endswith("inv_freq")
        if name in EXPERT_NAMES:
            assert torch.equal(got[name], mxfp4_roundtrip(t, rule)), name
            assert not torch.equal(got[name], t), name  # really went through MXFP4
        else:
            assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), name  # bit for bit
    kinds = {e.name: e for b in bundle.buckets for e in b.entries}
    assert {n for n, e in kinds.items() if e.kind == EntryKind.MXFP4} == set(EXPERT_NAMES)
    assert all(kinds[n].scale_rule == rule for n in EXPERT_NAMES)


def test_default_predicate():
    t = torch.zeros(4, 64, 32)
    assert is_routed_expert("model.layers.0.mlp.experts.gate_up_proj", t)
    assert is_routed_expert("model.layers.7.mlp.experts.3.down_proj.weight", torch.zeros(64, 32))
    assert not is_routed_expert("model.layers.0.mlp.experts.gate_up_proj_bias", torch.zeros(4, 64))
    assert not is_routed_expert("model.layers.0.mlp.shared_experts.down_proj.weight", t)
    assert not is_routed_expert("model.layers.0.mlp.gate.weight", torch.zeros(4, 64))
    assert not is_routed_expert("model.layers.0.self_attn.q_proj.weight", t)


def test_buckets_respect_the_byte_bound_and_keep_order():
    sd = TinyMoE(0).state_dict()
    bound = 20_000
    bundle = build_bundle(sd, version=1, bucket_bytes=bound)
    assert len(bundle.buckets) >= 5
    names = [n for b in bundle.buckets for n in b.names]
    assert names == list(sd)
    for i, b in enumerate(bundle.buckets):
        assert b.index == i and b.version == 1
        assert b.nbytes <= bound or len(b.entries) == 1
        if i + 1 < len(bundle.buckets):  # greedy: the next entry did not fit
            assert b.nbytes + bundle.buckets[i + 1].entries[0].nbytes > bound
    assert bundle.total_bytes == sum(b.nbytes for b in bundle.buckets)
    # MXFP4 payload: K/2 + K/32 bytes per row of K
    gate_up = next(e for b in bundle.buckets for e in b.entries if e.name == EXPERT_NAMES[0])
    assert gate_up.nbytes == E * 2 * I * (H // 2 + H // 32)
    # lm_head (64 KiB fp32) exceeds the bound and sits alone
    big = [b for b in bundle.buckets if "lm_head.weight" in b.names]
    assert len(big) == 1 and big[0].names == ["lm_head.weight"] and big[0].nbytes > bound

    one = build_bundle(sd, version=1, bucket_bytes=1 << 30)
    assert len(one.buckets) == 1
    tiny = build_bundle(sd, version=1, bucket_bytes=1)
    assert [b.names for b in tiny.buckets] == [[n] for n in sd]


def test_streaming_buckets_equal_the_bundle():
    src, a, b = TinyMoE(0, torch.bfloat16), TinyMoE(1, torch.bfloat16), TinyMoE(1, torch.bfloat16)
    apply_bundle(a, build_bundle(src.state_dict(), 2, bucket_bytes=4096))
    for bucket in iter_buckets(src.state_dict(), 2, bucket_bytes=4096):
        apply_bucket(b, bucket, expected_version=2)
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k


def test_corrupted_payload_is_refused_naming_the_tensor_and_nothing_is_written():
    src, dst = TinyMoE(0), TinyMoE(1)
    before = _snapshot(dst)
    bundle = build_bundle(src.state_dict(), 1, bucket_bytes=10_000)
    victim = bundle.buckets[-1].entries[0]  # last bucket: earlier ones verify fine first
    victim.data.view(-1).view(torch.uint8)[7] ^= 0x10
    with pytest.raises(ValueError, match=rf"{victim.name}.*checksum"):
        apply_bundle(dst, bundle)
    _assert_unchanged(dst, before)


def test_corrupted_mxfp4_scales_are_refused():
    bundle = build_bundle(TinyMoE(0).state_dict(), 1)
    entry = next(e for b in bundle.buckets for e in b.entries if e.name == EXPERT_NAMES[3])
    entry.scales[0, 0, 0] ^= 1
    with pytest.raises(ValueError, match=EXPERT_NAMES[3]):
        apply_bundle(TinyMoE(1), bundle)


def test_tampered_metadata_fails_the_bucket_checksum():
    bundle = build_bundle(TinyMoE(0).state_dict(), 1, bucket_bytes=1 << 30)
    (bucket,) = bundle.buckets
    q, k = (i for i, e in enumerate(bucket.entries) if e.name.startswith("model.layers.0.self_attn.") and "proj" in e.name)
    entries = list(bucket.entries)
    entries[q], entries[k] = (  # swap the names of two same-shape tensors
        dataclasses.replace(entries[q], name=entries[k].name),
        dataclasses.replace(entries[k], name=entries[q].name),
    )
    bad = dataclasses.replace(bundle, buckets=(dataclasses.replace(bucket, entries=tuple(entries)),))
    with pytest.raises(ValueError, match="bucket 0.*checksum.*q_proj"):
        apply_bundle(TinyMoE(1), bad)


def test_missing_bucket_is_refused():
    bundle = build_bundle(TinyMoE(0).state_dict(), 1, bucket_bytes=10_000)
    with pytest.raises(ValueError, match="missing"):
        apply_bundle(TinyMoE(1), dataclasses.replace(bundle, buckets=bundle.buckets[:-1]))
    with pytest.raises(ValueError, match="out of place"):
        apply_bundle(TinyMoE(1), dataclasses.replace(bundle, buckets=bundle.buckets[1:]))


def test_shape_mismatch_and_unknown_name_are_refused():
    bundle = build_bundle(TinyMoE(0).state_dict(), 1)
    dst = TinyMoE(1, inter=2 * I)
    before = _snapshot(dst)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj.*shape"):
        apply_bundle(dst, bundle)
    _assert_unchanged(dst, before)

    target = dict(TinyMoE(1).state_dict())
    del target["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight.*not in"):
        apply_bundle(target, bundle)


def test_versions():
    bundle = build_bundle(TinyMoE(0).state_dict(), 4)
    dst = TinyMoE(1)
    with pytest.raises(ValueError, match="stale"):
        apply_bundle(dst, bundle, current_version=4)
    with pytest.raises(ValueError, match="expects 5"):
        apply_bundle(dst, bundle, expected_version=5)
    other = build_bundle(TinyMoE(0).state_dict(), 3)
    with pytest.raises(ValueError, match="out of place"):  # a bucket from another push
        apply_bundle(dst, dataclasses.replace(bundle, buckets=other.buckets))
    with pytest.raises(ValueError, match="expects 4"):
        apply_bucket(dst, other.buckets[0], expected_version=4)
    apply_bundle(dst, bundle, expected_version=4, current_version=3)


def test_bundle_pickles_and_is_a_snapshot():
    src = TinyMoE(0, torch.bfloat16)
    bundle = build_bundle(src.state_dict(), 7, bucket_bytes=8192)
    want = _snapshot(TinyMoE(0, torch.bfloat16))
    with torch.no_grad():  # a learner step after the push must not reach the bundle
        for p in src.parameters():
            p.add_(1.0)

    clone = pickle.loads(pickle.dumps(bundle))
    assert isinstance(clone, WeightBundle) and clone.version == 7
    assert [b.names for b in clone.buckets] == [b.names for b in bundle.buckets]
    a, b = TinyMoE(1, torch.bfloat16), TinyMoE(1, torch.bfloat16)
    apply_bundle(a, bundle)
    apply_bundle(b, clone)
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k
        ref = mxfp4_roundtrip(want[k]) if k in EXPERT_NAMES else want[k]
        assert torch.equal(v, ref), k


def test_dense_transfer_dtype_and_dequantize_dtype():
    src, dst = TinyMoE(0), TinyMoE(1)
    bundle = build_bundle(src.state_dict(), 1, dense_dtype=torch.bfloat16)
    q = next(e for b in bundle.buckets for e in b.entries if e.name == "lm_head.weight")
    assert q.data.dtype == torch.bfloat16 and q.dtype == torch.float32
    apply_bundle(dst, bundle, dtype=torch.bfloat16)
    for name, t in src.state_dict().items():
        ref = mxfp4_roundtrip(t) if name in EXPERT_NAMES else t.bfloat16().float()
        assert torch.equal(dst.state_dict()[name], ref), name


def test_sender_errors():
    with pytest.raises(ValueError, match=r"'w'.*\(4, 48\)"):
        build_bundle({"w": torch.zeros(4, 48)}, 0, is_quantized=lambda n, t: True)
    with pytest.raises(ValueError, match="scale_rule"):
        build_bundle({}, 0, scale_rule="nearest")
    with pytest.raises(ValueError, match="bucket_bytes"):
        build_bundle({}, 0, bucket_bytes=0)
    assert build_bundle({}, 0) == WeightBundle(0, (), 0)


# -- MXFP4-resident experts (hold_mxfp4_experts: what an engine on the triton table keeps) ----------------------

def _moe_pair(seed: int = 3):
    """A tiny MoETransformer (the receiver) and a perturbed copy's state (the learner's)."""
    from jointrl.model import MoEConfig, MoETransformer  # the real model class: Experts.load_mxfp4's shapes

    config = MoEConfig(initializer_range=0.1)
    model = MoETransformer.from_config(config, dtype=torch.float32, seed=seed, kernels="torch")
    g = torch.Generator().manual_seed(seed + 1)
    state = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}
    return model, state


def _experts(model):
    return [layer.mlp.experts for layer in model.model.layers]


def test_whole_mxfp4_experts_are_held_as_pushed_and_forward_as_their_dequantized_weights():
    from jointrl.rl.weight_sync import hold_mxfp4_experts

    model, state = _moe_pair()
    bundle = build_bundle(state, version=1)
    apply_bundle(model, bundle)
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        dense = model(ids).logits
    assert hold_mxfp4_experts(model, bundle) == len(_experts(model))
    entries = {e.name: e for b in bundle.buckets for e in b.entries}
    for i, ex in enumerate(_experts(model)):
        gu = entries[f"model.layers.{i}.mlp.experts.gate_up_proj"]
        assert torch.equal(ex.mxfp4_gate_up_blocks, gu.data) and torch.equal(ex.mxfp4_gate_up_scales, gu.scales)
    with torch.no_grad():
        held = model(ids).logits
    torch.testing.assert_close(held, dense, rtol=1e-5, atol=1e-5)  # the held pair decodes to the written weights


def test_expert_parallel_slices_assemble_then_update_rows_and_a_dense_push_drops_the_pair():
    from jointrl.rl.weight_sync import hold_mxfp4_experts, merge_bundles

    model, state = _moe_pair()
    E = _experts(model)[0].gate_up_proj.shape[0]
    shared = {k: v for k, v in state.items() if not is_routed_expert(k)}
    halves = [{k: v[lo : lo + E // 2] for k, v in state.items() if is_routed_expert(k)} for lo in (0, E // 2)]
    offsets = [dict.fromkeys(h, lo) for h, lo in zip(halves, (0, E // 2))]
    bundles = [build_bundle({**shared, **halves[0]}, 1, row_offsets=offsets[0]),
               build_bundle(halves[1], 1, row_offsets=offsets[1])]
    merged = merge_bundles(bundles)
    apply_bundle(model, merged)
    assert hold_mxfp4_experts(model, merged) == 2  # slices covering every expert assemble into one pair
    whole = {e.name: e for b in build_bundle(state, 1).buckets for e in b.entries}
    for i, ex in enumerate(_experts(model)):
        assert torch.equal(ex.mxfp4_down_blocks, whole[f"model.layers.{i}.mlp.experts.down_proj"].data)
    # a later push of the second rank's experts only: those rows of the held pair change, the others stay
    second = {k: -v for k, v in halves[1].items()}
    partial = build_bundle(second, 2, row_offsets=offsets[1])
    before = _experts(model)[0].mxfp4_gate_up_blocks.clone()
    apply_bundle(model, partial)
    assert hold_mxfp4_experts(model, partial) == 2
    now = _experts(model)[0].mxfp4_gate_up_blocks
    want = {e.name: e for b in partial.buckets for e in b.entries}["model.layers.0.mlp.experts.gate_up_proj"]
    assert torch.equal(now[: E // 2], before[: E // 2]) and torch.equal(now[E // 2 :], want.data)
    assert not torch.equal(now, before)
    # experts pushed dense: no stale MXFP4 pair survives
    dense = build_bundle(state, 3, is_quantized=lambda name, t: False)
    apply_bundle(model, dense)
    assert hold_mxfp4_experts(model, dense) == 0
    assert all(ex.mxfp4_gate_up_blocks is None for ex in _experts(model))
