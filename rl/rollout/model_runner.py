"""``ModelRunner``: one forward of the model over a flat, ragged batch with a paged KV cache.

Kernels: the model's kernel table (``model.kernels``, ``kernels/ops.Kernels``), chosen when the model was
built; the C++ paths below run on the ``cpu`` backend only (``Kernels.cpp``), the torch references or the
Triton kernels otherwise. Measurements behind the choices below: tests/bench/results.md, "ModelRunner".

Models whose layers are all plain full attention take the flat path: it reuses the model's own modules
and weights (projections, q/k-norm, RoPE, the MoE block, norms, head); only attention's cache handling
differs from ``MoETransformer.forward``. Every other model runs through the model's own forward over
``PagedState`` (each layer kind brings its state, declared by its ``StateSpec``: ``_run_per_sequence``).
On the flat path all new tokens of a step -- one per decoding sequence, a chunk per prefilling one --
are flattened to N rows: every projection and the MoE (tokens grouped by expert, one matmul per active
expert) run once over all N; at any row count the dense projections -- q|k|v, o, router, head -- through
``kernels/linear_cpu`` against weights packed once per weights version (faster than MKL's sgemm here at
every row count measured, a decode step's 16 to a prefill chunk's 2048), and the routed experts through
their own packed copy (``kernels/moe_cpu.moe_experts_packed``: faster than the unpacked loop at decode
and than ``model.moe.Experts``' per-expert matmuls at a prefill chunk; the copy costs the expert
weights' bytes once more; after a weight update the panels are refilled in place, one strided copy
each). A step whose prefill chunks are all short (``SHORT_PREFILL``: a GRPO group's other members after
the shared prompt's full blocks) runs every row's attention as a decode query through the paged-decode
kernel, as batch-invariant mode does (faster than the key gather, mask and SDPA call per chunk it
replaced; the same as ``paged_prefill``'s rows-in-lanes kernel within the noise). A pure decode step of
a plain Qwen3-MoE-shaped model runs its layers from a per-layer plan of those C++ calls and their
prepared weights (``_decode_plan``, a ``LayerPlan`` per layer: no module lookups, cache checks or
wrappers per layer, one ``decode_layer`` C++ call each; bit for bit the general path). Attention then reads each sequence's keys/values
through its block table, in place: the decoding rows in one paged-decode call, all the step's prefill
chunks in one paged-prefill call.

Cache layout: ``kv_LPCHD`` [layers, num_blocks·block_size slots, 2 (k, v), kv heads, D];
block b holds slots [b·bs, (b+1)·bs). Keys are stored after q/k-norm and RoPE. Decode
attention reads them in place (``kernels/paged_attention_cpu.paged_decode``: a gather in
torch would copy the whole cache every step), and so do prefill chunks (``paged_prefill``, float32; a
float64 or bfloat16 model gathers each chunk's keys for one SDPA call per chunk). The pool and
the packed expert panels sit in transparent huge pages where the OS allows
(``cpu_extension.zeros_huge_pages``: a step reads them in scattered 16 KB pieces, each 4 KB page a TLB
miss otherwise). A float32
model's expert panels are bfloat16 whenever every expert weight is exactly a bfloat16, as after an MXFP4
weight update (``moe_cpu.pack_experts_bf16``; ``bf16_expert_panels``): the kernel widens them exactly on
load, so the results are the float32 panels' bit for bit, from half the bytes.

bfloat16 cache (``kv_dtype=torch.bfloat16``, ``rollout.kv_dtype: bfloat16``; float32 full-attention
models only, opt-in): keys and values are rounded to bfloat16 when stored and widened exactly when
read, everything else stays float32. Half the cache bytes per decode step (the step streams the
whole cache), at the price of exactness: outputs then match the float32 engine only within
bfloat16's rounding of the keys and values (tests/rl/rollout/test_kv_dtype.py states the bound).

Batch-invariant mode (``batch_invariant=True``, ``rollout.batch_invariant``): a row's result
depends only on its sequence's tokens and the weights, never on which other requests share the
step or on how a prompt was cut into prefill chunks, so a seeded request replays bit for bit
(resume after a crash, arrival order). Why it is needed: BLAS picks its kernel, and with it the
order of a dot product's sum, by the row count (here a row of ``F.linear`` over 1, 2, 4 or 64 rows
gives three different float32 results). So every projection, the MoE block (router, experts --
always the per-token C++ loop of ``kernels/moe_cpu`` -- and shared experts) and the head run
on tiles of exactly ``ROW_TILE`` rows (the last one zero-padded), and attention runs every
query, prefill ones included, through the decode kernel (one query against its keys ``0..pos``
in fixed 16-token tiles). Full-attention models only; it needs both C++ kernels built.

Shapes: N new tokens, Bd decoding sequences, S keys of a sequence, Hq/Hkv heads, D head_dim,
V vocab, L layers, k experts per token.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from jointrl.kernels import decode_cpu, linear_cpu, moe_cpu, paged_attention_cpu
from jointrl.kernels.cpu_extension import zeros_huge_pages
from jointrl.kernels.norm_rope_cpu import rms_norm_torch
from jointrl.model import MoETransformer
from jointrl.model.attention import Attention
from jointrl.model.norm import RMSNorm
from jointrl.model.rope import rotate_half
from jointrl.rl.image_inputs import slot_patches
from jointrl.rl.rollout.paged_state import DecodeBatchState, PagedState
from jointrl.rl.rollout.sequence import Sequence

ROW_TILE = 16  # batch_invariant: rows per GEMM call (a fixed shape, so a fixed summation order per row)
SHORT_PREFILL = 16  # prefill chunks of at most this many tokens attend as decode rows (``run``)


@dataclass(slots=True)
class LayerPlan:
    """One decoder layer of ``ModelRunner._decode_plan``: its cache pool and the prepared weights the C++ calls take."""

    kv_PCHD: torch.Tensor        # the layer's cache pool
    w_in: torch.Tensor           # input RMSNorm weight [H]
    eps_in: float
    qkv_p: torch.Tensor          # q|k|v projection, packed (linear_cpu.pack)
    qkv_out: int                 # its output width (Hq + 2·Hkv)·D
    qk_norm_w: torch.Tensor      # [Hq + Hkv, D] per-head q/k-norm weights, or empty: no q/k-norm
    qk_eps: float
    o_p: torch.Tensor            # o projection, packed
    hidden: int                  # H
    w_post: torch.Tensor         # post-attention RMSNorm weight [H]
    eps_post: float
    gate_p: torch.Tensor         # router projection, packed
    num_experts: int             # E
    top_k: int
    norm_topk: bool
    route_scale: float
    experts: tuple[torch.Tensor, torch.Tensor, int]  # (gate_up, down panels, I): moe_cpu.moe_experts_packed


@dataclass(slots=True)
class DecodePlan:
    """A pure decode step of a plain Qwen3-MoE-shaped model: its layers, then the final norm and the head."""

    layers: list[LayerPlan]
    w_norm: torch.Tensor
    eps_norm: float
    head_p: torch.Tensor         # lm_head, packed
    vocab: int                   # V


class ModelRunner:
    def __init__(self, model: MoETransformer, num_blocks: int, block_size: int, batch_invariant: bool = False,
                 kv_dtype: torch.dtype | None = None) -> None:
        cfg = model.config
        mixers = [layer.self_attn for layer in model.model.layers]
        specs = [mixer.state_spec for mixer in mixers]  # what each layer keeps per sequence (model.state.StateSpec)
        # every layer plain full attention: the flat ragged path below; any other kind runs through the
        # model's own forward over PagedState, whatever state its layers declare
        self.hybrid = not all(type(mixer) is Attention for mixer in mixers)
        self.prefix_cacheable = not any(spec.fixed for spec in specs)  # a fixed-size state is not per block
        self.invariant = batch_invariant
        if batch_invariant:
            _check_batch_invariant(self.hybrid, next(model.parameters()).dtype, model.kernels.cpp)
        self.model, self.bs = model, block_size
        self.kernels = model.kernels  # the model's kernel backend (model.kernels), chosen when it was built
        self.dtype = next(model.parameters()).dtype
        self.kv_dtype = kv_dtype or self.dtype  # the cache's dtype (module docstring: bfloat16 cache)
        if self.kv_dtype != self.dtype and (self.hybrid or (self.dtype, self.kv_dtype) != (torch.float32, torch.bfloat16)):
            raise ValueError(f"rollout.kv_dtype={self.kv_dtype} needs a float32 model with full-attention layers only "
                             f"(this one: {self.dtype}, hybrid={self.hybrid}); use auto (the model's dtype)")
        self.Hq, self.Hkv, self.D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        P = num_blocks * block_size
        kv_layers = [i for i, spec in enumerate(specs) if spec.keys_values]
        index_layers = [i for i, spec in enumerate(specs) if spec.index_dim]
        index_dims = {specs[i].index_dim for i in index_layers}
        assert len(index_dims) <= 1, f"one indexer-key width per model, got {index_dims}"
        self.pool_index = {layer: j for j, layer in enumerate(kv_layers)}      # layer -> kv_LPCHD row
        self.index_pool = {layer: j for j, layer in enumerate(index_layers)}  # layer -> index_LPD row
        latent_layers = [i for i, spec in enumerate(specs) if spec.latent_dim]  # MLA: one latent per token
        latent_dims = {specs[i].latent_dim for i in latent_layers}
        assert len(latent_dims) <= 1, f"one latent width per model, got {latent_dims}"
        self.latent_pool = {layer: j for j, layer in enumerate(latent_layers)}  # layer -> latent_LPD row
        # the pools live on the model's device; on the host in transparent huge pages where the OS allows
        # (a decode step reads it in scattered 16 KB blocks)
        self.device = next(model.parameters()).device
        kv_shape = (len(kv_layers), P, 2, self.Hkv, self.D)
        self.kv_LPCHD = (zeros_huge_pages(kv_shape, self.kv_dtype) if self.device.type == "cpu"
                         else torch.zeros(kv_shape, dtype=self.kv_dtype, device=self.device))
        self.index_LPD = torch.zeros(len(index_layers), P, max(index_dims, default=1), dtype=self.dtype,
                                     device=self.device)
        self.latent_LPD = torch.zeros(len(latent_layers), P, max(latent_dims, default=1), dtype=self.dtype,
                                      device=self.device)
        self._fused: dict[int, tuple[tuple, torch.Tensor]] = {}
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # (cos_PD, sin_PD) by position  # id(attention) -> (weights' versions, qkv weight)
        self.image = (cfg.image_token_id, cfg.image_patch_dim) if getattr(cfg, "image_patch_dim", 0) else None
        # per-row C++ ops (kernels/decode_cpu) for norms, q/k-norm + RoPE + KV write (a bfloat16 cache too)
        # and the softmax router; batch-invariant mode keeps its tiled torch path
        self.fast = (self.kernels.cpp and not self.invariant and self.dtype in (torch.float32, torch.float64)
                     and decode_cpu.load_kernel() is not None)
        # the dense projections of a few rows (q|k|v, o, router, head) against weights packed once
        # (kernels/linear_cpu: ~2x MKL's sgemm at 16 rows on weights streamed from memory each step)
        self.packed_linear = self.fast and linear_cpu.load_kernel() is not None
        self._plan: tuple[tuple, DecodePlan] | None = None  # (weights key, the plan): _decode_plan
        self._plan_refs: list[tuple[dict, str]] | None = None  # _plan_params' lookups ([]: no plan for this model)

    def _qkv_weight(self, attn) -> torch.Tensor:
        """q, k, v projections as one [(Hq + 2·Hkv)·D, H] weight (one matmul instead of three),
        rebuilt when any of them changes: ``update_weights`` copies in place, which bumps a
        tensor's version counter; a replaced parameter has a new address."""
        ws = (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)
        key = tuple((w.data_ptr(), w._version) for w in ws)
        cached = self._fused.get(id(attn))
        if cached is None or cached[0] != key:
            cached = self._fused[id(attn)] = (key, torch.cat(ws))
        return cached[1]

    def _packed(self, x_NK: torch.Tensor, *ws: torch.Tensor) -> torch.Tensor:
        """x_NK @ cat(ws).T for bias-free projections through ``kernels/linear_cpu``."""
        return linear_cpu.linear(x_NK, *self._packed_weight(*ws))

    def _packed_weight(self, *ws: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(``linear_cpu.pack(cat(ws))``, its output count), cached and rebuilt like ``_qkv_weight``'s when
        any of ``ws`` changes. The entry is keyed by ``id(ws[0])`` and also holds weak references to ``ws``:
        after parameters are replaced, a later parameter can get a freed one's id *and* its freed memory
        (same address, version 0), so addresses and versions alone would hand it another weight's panels;
        and the entry goes when ``ws[0]`` is freed (no packed copies of replaced weights left behind)."""
        slot = (id(ws[0]), len(ws))
        key = tuple((w.data_ptr(), w._version) for w in ws)
        cached = self._fused.get(slot)
        if cached is None or cached[0] != key or any(r() is not w for r, w in zip(cached[2], ws)):
            w = ws[0] if len(ws) == 1 else torch.cat(ws)
            if _same_params(cached, ws) and cached[1][1] == w.shape[0]:  # new values (update_weights): into the old panels
                cached = self._fused[slot] = (key, (linear_cpu.pack(w, out=cached[1][0]), w.shape[0]), *cached[2:])
            else:
                refs = (weakref.ref(ws[0], _dropper(weakref.ref(self), slot)), *map(weakref.ref, ws[1:]))
                cached = self._fused[slot] = (key, (linear_cpu.pack(w), w.shape[0]), refs, _layout(ws))
        return cached[1]

    def _packed_experts(self, experts) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(gate_up, down panels of ``moe_cpu.pack_experts``, I) of ``experts``, cached and rebuilt like
        ``_packed_weight``'s (keyed by ``id(gate_up_proj)``, dropped when it is freed)."""
        ws = (experts.gate_up_proj, experts.down_proj)
        slot = (id(ws[0]), "experts")
        key = tuple((w.data_ptr(), w._version) for w in ws)
        cached = self._fused.get(slot)
        if cached is None or cached[0] != key or any(r() is not w for r, w in zip(cached[2], ws)):
            if _same_params(cached, ws):  # new values (update_weights): repacked into the old panels in place
                cached = self._fused[slot] = (key, (*self._pack_experts(ws, cached[1][:2]), cached[1][2]), *cached[2:])
            else:
                refs = (weakref.ref(ws[0], _dropper(weakref.ref(self), slot)), weakref.ref(ws[1]))
                cached = self._fused[slot] = (key, (*self._pack_experts(ws, None), ws[1].shape[2]), refs, _layout(ws))
        return cached[1]

    # Expert panels in bfloat16 when every weight of a float32 model's experts is exactly a bfloat16, as
    # after an MXFP4 weight update (``moe_cpu.pack_experts_bf16``): half the bytes a decode step streams,
    # the same result bit for bit. A test turns it off to compare.
    bf16_expert_panels = True

    def _pack_experts(self, ws: tuple[torch.Tensor, torch.Tensor], old: tuple[torch.Tensor, torch.Tensor] | None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """``ws``' panels in transparent huge pages: in bfloat16 where exact, else in the weights' dtype;
        into ``old`` (the previous version's panels) when its dtype is the one they get."""
        # one row as a cheap first test (a float32 weight off the bfloat16 grid has low bits set), so a dense
        # push does not allocate bfloat16 panels at every update only to have them refused
        if (self.bf16_expert_panels and self.dtype == torch.float32
                and not (ws[0][0, 0].detach().view(torch.int32) & 0xFFFF).any()):
            out = old if old is not None and old[0].dtype == torch.bfloat16 else tuple(
                zeros_huge_pages(shape, torch.bfloat16) for shape in moe_cpu.panel_shapes(*ws))
            if moe_cpu.pack_experts_bf16(*ws, out):
                return out
        if old is not None and old[0].dtype == ws[0].dtype:
            return moe_cpu.pack_experts(*ws, out=old)
        return tuple(zeros_huge_pages(p.shape, p.dtype).copy_(p) for p in moe_cpu.pack_experts(*ws))

    def _rope(self, pos_N: torch.Tensor, need: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos_ND, sin_ND) of ``rotary_emb`` at ``pos_N`` (``need``: max(pos_N) + 1, a host int: no device
        sync), looked up in a table of positions 0..P-1 built by
        ``rotary_emb`` itself (elementwise in the position: the same values up to the vectorized cos/sin's
        last ulp) and doubled when a position passes it -- one index per step instead of ~10 ops."""
        table = self._rope_table
        if table is None or table[0].shape[0] < need or table[0].dtype != dtype:
            size = max(1024, 1 << (need - 1).bit_length())
            cos_1PD, sin_1PD = self.model.model.rotary_emb(torch.arange(size, device=self.device)[None], dtype)
            table = self._rope_table = (cos_1PD[0], sin_1PD[0])
        return table[0][pos_N], table[1][pos_N]

    def _qk_norm_weight(self, attn) -> torch.Tensor | None:
        """Per-head q- and k-norm weights as one [Hq + Hkv, D] table (None unless both are
        per-head ``RMSNorm``s with one eps), cached like ``_qkv_weight``."""
        qn, kn = attn.q_norm, attn.k_norm
        if type(qn) is not RMSNorm or type(kn) is not RMSNorm or qn.eps != kn.eps:
            return None
        key = tuple((w.data_ptr(), w._version) for w in (qn.weight, kn.weight))
        cached = self._fused.get(id(qn))
        if cached is None or cached[0] != key:
            cached = self._fused[id(qn)] = (key, torch.cat((qn.weight.expand(self.Hq, self.D),
                                                             kn.weight.expand(self.Hkv, self.D))))
        return cached[1]

    def _norm(self, norm: RMSNorm, x_NH: torch.Tensor) -> torch.Tensor:
        """``norm(x_NH)`` (the model's kernel table); on the fast path one ``decode_cpu`` call."""
        if self.fast and x_NH.dim() == 2:
            return decode_cpu.rms_norm(x_NH, norm.weight, norm.eps)
        return norm(x_NH)

    @property
    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.kv_LPCHD, self.index_LPD, self.latent_LPD))

    def _patches(self, parts: list[tuple[Sequence, int]]) -> torch.Tensor | None:
        """``image_patches`` for the next ``n`` tokens of each ``(seq, n)``, in that order (None for a
        text-only model): the sequence's screenshot rows by ``slot_patches``' rule."""
        if self.image is None:
            return None
        image_id, dim = self.image
        rows = [slot_patches(seq.token_ids, seq.images, image_id, dim, seq.num_computed, seq.num_computed + n)
                for seq, n in parts if image_id in seq.token_ids[seq.num_computed:seq.num_computed + n]]
        # the request's patches arrive on the host: one copy to the engine's device (none on the host)
        return torch.cat(rows).to(self.device) if rows else torch.zeros(0, dim, dtype=self.dtype, device=self.device)

    def _slots(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end, device=self.device)
        return torch.tensor(seq.block_table, device=self.device)[pos // self.bs] * self.bs + pos % self.bs

    @torch.no_grad()
    def run(self, batch: list[tuple[Sequence, int]], want_routed: bool = False
            ) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
        """Forward ``batch`` [(seq, n new tokens)] and write the new keys/values to the cache.

        → (logits_RV for the R sequences whose new tokens reach their end, in batch order;
        their batch indices; routed expert ids [N, L, k] when ``want_routed``).
        """
        if self.hybrid:
            return self._run_per_sequence(batch, want_routed)
        bs = self.bs
        order = [i for i, (_, n) in enumerate(batch) if n == 1] + [i for i, (_, n) in enumerate(batch) if n > 1]
        n_dec = sum(1 for _, n in batch if n == 1)
        first_row = [0] * len(batch)
        for r, i in enumerate(order[:n_dec]):
            first_row[i] = r
        ids, pos, slots = [], [], []
        for seq, n in (batch[i] for i in order[:n_dec]):
            c = seq.num_computed
            ids.append(seq.token_ids[c])
            pos.append(c)
            slots.append(seq.block_table[c // bs] * bs + c % bs)
        dev = self.device  # every index tensor of the step on the engine's device (host lists built first)
        ids_N, pos_N = torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(pos, dtype=torch.long, device=dev)
        slot_N = torch.tensor(slots, dtype=torch.long, device=dev)
        prefill = []  # (row offset, n, start, key slots [S])
        row = n_dec
        parts_ids, parts_pos, parts_slot = [ids_N], [pos_N], [slot_N]
        for i in order[n_dec:]:
            seq, n = batch[i]
            first_row[i] = row
            c = seq.num_computed
            key_slots_S = self._slots(seq, 0, c + n)
            parts_ids.append(torch.tensor(seq.token_ids[c:c + n], dtype=torch.long, device=dev))
            parts_pos.append(torch.arange(c, c + n, device=dev))
            parts_slot.append(key_slots_S[c:])
            prefill.append((row, n, c, key_slots_S))
            row += n
        if prefill:
            ids_N, pos_N, slot_N = torch.cat(parts_ids), torch.cat(parts_pos), torch.cat(parts_slot)
        n_pos = max([p + 1 for p in pos] + [c + n for _, n, c, _ in prefill])  # max(pos_N) + 1, from host ints

        dec_slots_BS = ctx_B = None
        if n_dec:
            ctx_B = pos_N[:n_dec] + 1
            S = max(pos[:n_dec]) + 1  # host ints: no device sync
            M = -(-S // bs)
            tables = [batch[i][0].block_table[:M] for i in order[:n_dec]]
            table_BM = torch.tensor([t + [0] * (M - len(t)) for t in tables], dtype=torch.long, device=dev)  # one call per step
            dec_slots_BS = (table_BM[:, :, None] * bs + torch.arange(bs, device=dev)).view(n_dec, M * bs)[:, :S].contiguous()
        # every row a decode query, its keys 0..pos read through the decode kernel: batch-invariant mode, and
        # steps whose prefill chunks are all short (a GRPO group's members after the shared prompt's full
        # blocks: one kernel call per layer; faster than SDPA per chunk, even with paged_prefill: docstring)
        rows_as_decode = self.invariant or (prefill and self.fast and paged_attention_cpu.load_kernel() is not None
                                            and all(n <= SHORT_PREFILL for _, n, _, _ in prefill))
        if rows_as_decode:
            all_slots_NS = torch.zeros(len(ids_N), n_pos, dtype=torch.long, device=dev)
            if n_dec:
                all_slots_NS[:n_dec, :dec_slots_BS.shape[1]] = dec_slots_BS
            for r0, n, c, key_slots_S in prefill:
                all_slots_NS[r0:r0 + n, :c + n] = key_slots_S
            all_ctx_N = pos_N + 1
        chunks = None  # the prefill chunks' key slots and rows, once for every layer's paged_prefill
        if prefill and not rows_as_decode:
            slots_CS = torch.zeros(len(prefill), max(c + n for _, n, c, _ in prefill), dtype=torch.long, device=dev)
            for j, (_, n, c, key_slots_S) in enumerate(prefill):
                slots_CS[j, :c + n] = key_slots_S
            chunks = (slots_CS, *torch.tensor([(c, r0, n) for r0, n, c, _ in prefill], dtype=torch.long, device=dev).T)

        m = self.model
        x_NH = m.model.embed_tokens(ids_N)
        if self.image is not None and bool((ids_N == self.image[0]).any()):
            x_NH = m.model.image_projector.merge(x_NH[None], ids_N[None], self._patches([batch[i] for i in order]))[0]
        cos_ND, sin_ND = self._rope(pos_N, n_pos, x_NH.dtype)
        packed = self.packed_linear  # the dense projections through kernels/linear_cpu, at any row count
        if packed and not prefill and self.image is None:
            plan = self._decode_plan()
            if plan is not None:
                return self._decode_planned(plan, x_NH, cos_ND, sin_ND, slot_N, dec_slots_BS, ctx_B, batch, want_routed)
        routed = []
        for layer_idx, layer in enumerate(m.model.layers):
            kv_PCHD = self.kv_LPCHD[self.pool_index[layer_idx]]
            attn = layer.self_attn
            h_NH = self._norm(layer.input_layernorm, x_NH)
            N = h_NH.shape[0]
            if packed:
                qkv_NF = self._packed(h_NH, attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)
            else:
                qkv_weight = self._qkv_weight(attn)
                qkv_NF = self._rows(lambda t: F.linear(t, qkv_weight), h_NH)
            qk_norm_HD = self._qk_norm_weight(attn)
            if self.fast and (qk_norm_HD is not None or _no_qk_norm(attn)):  # norm, RoPE, KV write: one call
                q_NHD = decode_cpu.qk_norm_rope_store(qkv_NF, qk_norm_HD, getattr(attn.q_norm, "eps", 0.0), cos_ND,
                                                      sin_ND, kv_PCHD, slot_N, self.Hq, self.Hkv)
            else:
                q_NHD = self._qk_rope_store(attn, qkv_NF, qk_norm_HD, cos_ND[:, None], sin_ND[:, None], kv_PCHD, slot_N)
            if rows_as_decode:
                out_NHD = self.kernels.paged_decode(q_NHD, kv_PCHD, all_slots_NS, all_ctx_N, self.D ** -0.5)
            else:
                out_NHD = self._attention(q_NHD, kv_PCHD, n_dec, dec_slots_BS, ctx_B, chunks)
            out_NF = out_NHD.reshape(N, self.Hq * self.D)
            if getattr(attn, "gate_proj", None) is not None:  # sigmoid output gate
                out_NF = out_NF * torch.sigmoid(self._rows(attn.gate_proj, h_NH))
            if packed and attn.o_proj.bias is None:
                x_NH = x_NH + self._packed(out_NF, attn.o_proj.weight)
            else:
                x_NH = x_NH + self._rows(attn.o_proj, out_NF)
            h_NH = self._norm(layer.post_attention_layernorm, x_NH)
            if not getattr(layer, "is_moe", True):  # a dense first layer
                x_NH = x_NH + self._rows(layer.mlp, h_NH)
                continue
            y_NH, ids_Nk = self._moe(layer.mlp, h_NH, packed)
            x_NH = x_NH + y_NH
            if want_routed:
                routed.append(ids_Nk)

        ends = [i for i, (seq, n) in enumerate(batch) if seq.num_computed + n == len(seq)]
        h_RH = self._norm(m.model.norm, x_NH[[first_row[i] + batch[i][1] - 1 for i in ends]])
        if packed and m.lm_head.bias is None:
            logits_RV = self._packed(h_RH, m.lm_head.weight)
        else:
            logits_RV = self._rows(m.lm_head, h_RH)
        routed_NLk = None
        if want_routed:  # back to batch order
            rows = torch.tensor([r for i, (_, n) in enumerate(batch) for r in range(first_row[i], first_row[i] + n)],
                                dtype=torch.long, device=self.device)
            routed_NLk = torch.stack(routed, dim=1)[rows]
        return logits_RV, ends, routed_NLk

    def _decode_plan(self) -> DecodePlan | None:
        """What a pure decode step calls per layer, the weights packed and fused (``LayerPlan`` per layer, the
        final norm and head in ``DecodePlan``); None unless every layer has the plain shape the C++ path covers
        (full attention with RMSNorm q/k-norm or none, no output gate, bias-free projections, a softmax-routed
        MoE without shared experts, RMSNorm norms; a bfloat16 cache too: the same calls take it). Rebuilt when any weight
        changes in place (its version) or is replaced (its address), like ``_qkv_weight``."""
        params = self._plan_params()
        if params is None:
            return None
        key = tuple((p.data_ptr(), p._version) for p in params)
        if self._plan is not None and self._plan[0] == key:
            return self._plan[1]
        m, layers = self.model, []
        for layer_idx, layer in enumerate(m.model.layers):
            attn, mlp, (in_norm, post_norm) = layer.self_attn, layer.mlp, (layer.input_layernorm, layer.post_attention_layernorm)
            qk_norm_HD = self._qk_norm_weight(attn)
            gate = mlp.gate
            qkv_p, qkv_out = self._packed_weight(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)
            o_p, hidden = self._packed_weight(attn.o_proj.weight)
            gate_p, num_experts = self._packed_weight(gate.weight)
            layers.append(LayerPlan(
                kv_PCHD=self.kv_LPCHD[self.pool_index[layer_idx]], w_in=in_norm.weight.detach(), eps_in=in_norm.eps,
                qkv_p=qkv_p, qkv_out=qkv_out,
                qk_norm_w=qk_norm_HD.detach() if qk_norm_HD is not None else in_norm.weight.new_empty(0),
                qk_eps=getattr(attn.q_norm, "eps", 0.0), o_p=o_p, hidden=hidden, w_post=post_norm.weight.detach(),
                eps_post=post_norm.eps, gate_p=gate_p, num_experts=num_experts, top_k=gate.top_k,
                norm_topk=gate.norm_topk_prob, route_scale=gate.routed_scaling_factor,
                experts=self._packed_experts(mlp.experts)))
        head_p, vocab = self._packed_weight(m.lm_head.weight)
        plan = DecodePlan(layers, m.model.norm.weight.detach(), m.model.norm.eps, head_p, vocab)
        self._plan = (key, plan)
        return plan

    def _plan_params(self) -> list[torch.Tensor] | None:
        """The parameters ``_decode_plan`` reads, looked up in their modules' parameter tables (a parameter
        replaced by assignment shows; a cheap lookup, unlike ``Module.__getattr__``), or None when a layer is
        not of the plan's shape (decided once)."""
        if self._plan_refs is None:
            m = self.model
            if not _plain_decode_shape(m):
                self._plan_refs = []
                return None
            mods = [(m.model.norm, "weight"), (m.lm_head, "weight")]
            for layer in m.model.layers:
                attn, mlp = layer.self_attn, layer.mlp
                mods += [(layer.input_layernorm, "weight"), (layer.post_attention_layernorm, "weight"),
                         (attn.q_proj, "weight"), (attn.k_proj, "weight"), (attn.v_proj, "weight"),
                         (attn.o_proj, "weight"), (mlp.gate, "weight"), (mlp.experts, "gate_up_proj"),
                         (mlp.experts, "down_proj")]
                if not _no_qk_norm(attn):
                    mods += [(attn.q_norm, "weight"), (attn.k_norm, "weight")]
            self._plan_refs = [(mod._parameters, name) for mod, name in mods]
        return [table[name] for table, name in self._plan_refs] if self._plan_refs else None

    def _decode_planned(self, plan, x_NH, cos_ND, sin_ND, slot_N, slots_BS, ctx_B, batch, want_routed
                        ) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
        """``run``'s layers for a pure decode step (every row one sequence's next token, in batch order): the
        same C++ calls as the general path, straight from the plan (no per-layer module lookups, cache
        checks or wrappers), the residual adds in place; each layer's nine of them inside one registry call
        (``decode_cpu``'s ``decode_layer``)."""
        dl, ll = decode_cpu.load_kernel(), linear_cpu.load_kernel()
        layer_op = dl.decode_layer
        N, Hq, Hkv, scale = x_NH.shape[0], self.Hq, self.Hkv, self.D ** -0.5
        slots_BS, ctx_B = slots_BS.contiguous(), ctx_B.contiguous()
        routed = []
        for p in plan.layers:  # one C++ call per layer (decode_cpu's decode_layer: the nine calls, in order)
            ids_Nk = layer_op(x_NH, p.w_in, p.eps_in, p.qkv_p, p.qkv_out, p.qk_norm_w, p.qk_eps, cos_ND, sin_ND,
                              p.kv_PCHD, slot_N, slots_BS, ctx_B, scale, Hq, Hkv, p.o_p, p.hidden, p.w_post,
                              p.eps_post, p.gate_p, p.num_experts, p.top_k, p.norm_topk, p.route_scale, *p.experts)
            if want_routed:
                routed.append(ids_Nk)
        ends = [i for i, (seq, n) in enumerate(batch) if seq.num_computed + n == len(seq)]
        if len(ends) < N:  # a prompt's chunk cut to one token by the step's budget: no logits for it
            x_NH = x_NH[ends]
        logits_RV = ll.linear_packed(dl.rms_norm(x_NH, plan.w_norm, plan.eps_norm), plan.head_p, plan.vocab)
        return logits_RV, ends, torch.stack(routed, dim=1) if want_routed else None

    def _qk_rope_store(self, attn, qkv_NF, qk_norm_HD, cos_N1D, sin_N1D, kv_PCHD, slot_N) -> torch.Tensor:
        """q/k-norm and RoPE of the fused projection's q and k, k and v written at ``slot_N`` → q_NHD."""
        N = qkv_NF.shape[0]
        q_NF, k_NF, v_NF = qkv_NF.split((self.Hq * self.D, self.Hkv * self.D, self.Hkv * self.D), dim=-1)
        v_NHD = v_NF.reshape(N, self.Hkv, self.D)
        if qk_norm_HD is not None:  # q and k side by side: one norm and one RoPE over both
            qk_NHD = qkv_NF[:, :(self.Hq + self.Hkv) * self.D].view(N, self.Hq + self.Hkv, self.D)
            qk_NHD = rms_norm_torch(qk_NHD, qk_norm_HD, attn.q_norm.eps)
            qk_NHD = qk_NHD * cos_N1D + rotate_half(qk_NHD) * sin_N1D
            q_NHD, k_NHD = qk_NHD.split((self.Hq, self.Hkv), dim=1)
        else:
            q_NHD = attn.q_norm(q_NF.reshape(N, self.Hq, self.D))
            k_NHD = attn.k_norm(k_NF.reshape(N, self.Hkv, self.D))
            q_NHD = q_NHD * cos_N1D + rotate_half(q_NHD) * sin_N1D
            k_NHD = k_NHD * cos_N1D + rotate_half(k_NHD) * sin_N1D
        kv_PCHD.index_copy_(0, slot_N, torch.stack((k_NHD, v_NHD), dim=1).to(self.kv_dtype))
        return q_NHD

    def _attention(self, q_NHD, kv_PCHD, n_dec, dec_slots_BS, ctx_B, chunks) -> torch.Tensor:
        """The decoding rows in one paged-decode call, all prefill chunks -- ``chunks`` = (slots_CS, start_C,
        row0_C, count_C), or None -- in one paged-prefill call (each chunk's keys read in place; SDPA per chunk
        where the kernel does not apply)."""
        if chunks is None:  # a pure decode step: the kernel's output is the whole output
            return self.kernels.paged_decode(q_NHD, kv_PCHD, dec_slots_BS, ctx_B, self.D ** -0.5)
        out_NHD = torch.empty_like(q_NHD)
        if n_dec:
            out_NHD[:n_dec] = self.kernels.paged_decode(q_NHD[:n_dec], kv_PCHD, dec_slots_BS, ctx_B, self.D ** -0.5)
        return self.kernels.paged_prefill(q_NHD, kv_PCHD, *chunks, self.D ** -0.5, out_NHD)

    def _rows(self, fn, x_NH: torch.Tensor) -> torch.Tensor:
        """``fn`` (row-wise: [n, in] -> [n, out]) over the rows of ``x_NH``; batch-invariant: one call per
        tile of exactly ``ROW_TILE`` rows."""
        if not self.invariant:
            return fn(x_NH)
        N = x_NH.shape[0]
        tiles = F.pad(x_NH, (0, 0, 0, -N % ROW_TILE)).split(ROW_TILE)
        return torch.cat([fn(t) for t in tiles])[:N] if N else fn(x_NH)

    def _moe(self, mlp, h_NH: torch.Tensor, packed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The MoE block over the rows of ``h_NH`` → (y_NH, expert ids_Nk); batch-invariant: per tile.
        ``packed``: the router's projection through ``_packed``. The experts go through their packed copy
        whenever the C++ kernels build here, at any row count."""
        if self.fast and mlp.shared_experts is None and not mlp.gate.sigmoid:  # the router in one C++ call
            gate = mlp.gate
            logits_NE = self._packed(h_NH, gate.weight) if packed else F.linear(h_NH, gate.weight)
            ids_Nk, w_Nk = decode_cpu.route_softmax_topk(logits_NE, gate.top_k,
                                                         gate.norm_topk_prob, gate.routed_scaling_factor)
            ex = mlp.experts
            if self.packed_linear and moe_cpu.load_kernel() is not None:  # any row count (prefill chunks too)
                return moe_cpu.moe_experts_packed(h_NH, ids_Nk, w_Nk, *self._packed_experts(ex)), ids_Nk
            if moe_cpu.use_kernel(h_NH, ids_Nk, ex.gate_up_proj.shape[0], False):
                return moe_cpu.moe_experts(h_NH, ids_Nk, w_Nk, ex.gate_up_proj, ex.down_proj), ids_Nk
            return ex(h_NH, ids_Nk, w_Nk), ids_Nk
        if not self.invariant:
            y_1NH, _, _, ids_Nk = mlp(h_NH[None])
            return y_1NH[0], ids_Nk
        N = h_NH.shape[0]
        parts = [mlp(t[None]) for t in F.pad(h_NH, (0, 0, 0, -N % ROW_TILE)).split(ROW_TILE)]
        return torch.cat([p[0][0] for p in parts])[:N], torch.cat([p[3] for p in parts])[:N]

    def _run_per_sequence(self, batch: list[tuple[Sequence, int]], want_routed: bool
                          ) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
        """Hybrid models, through the model's own forward: every decoding sequence in one batched
        forward (``DecodeBatchState``), each prefill chunk in its own (``PagedState``)."""
        decoding = [i for i, (seq, n) in enumerate(batch) if n == 1 and seq.num_computed > 0]
        rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # batch index -> (logits [n, V], routed [n, L, k])
        if len(decoding) > 1:
            state = DecodeBatchState(self, [batch[i][0] for i in decoding])
            ids_B1 = torch.tensor([[batch[i][0].token_ids[batch[i][0].num_computed]] for i in decoding], device=self.device)
            out = self.model(ids_B1, position_ids=state.position_ids_B1, attention_mask=state.attention_mask_BS,
                             cache=state, image_patches=self._patches([batch[i] for i in decoding]))
            rows = {i: (out.logits[b], out.topk_ids[b]) for b, i in enumerate(decoding)}
        logits, ends, routed = [], [], []
        for i, (seq, n) in enumerate(batch):
            c = seq.num_computed
            if i not in rows:
                out = self.model(torch.tensor([seq.token_ids[c:c + n]], device=self.device),
                                 position_ids=torch.arange(c, c + n, device=self.device)[None],
                                 cache=PagedState(self, seq, n), image_patches=self._patches([(seq, n)]))
                rows[i] = (out.logits[0], out.topk_ids[0])
            if c + n == len(seq):
                ends.append(i)
                logits.append(rows[i][0][-1])
            if want_routed:
                routed.append(rows[i][1])
        logits_RV = torch.stack(logits) if logits else torch.empty(0, self.model.config.vocab_size, dtype=self.dtype,
                                                                     device=self.device)
        return logits_RV, ends, torch.cat(routed) if want_routed else None


def _layout(ws) -> tuple:
    return tuple((tuple(w.shape), w.dtype) for w in ws)


def _same_params(cached, ws) -> bool:
    """Whether a packed-weight cache entry (key, value, weak references, layout) was built from these very
    tensors, alive, with their shapes and dtypes: then only their values changed (``update_weights`` copies in
    place), and the entry's panels are refilled in place -- no new memory, no zeroing, no second copy."""
    return (cached is not None and len(cached[2]) == len(ws) and all(r() is w for r, w in zip(cached[2], ws))
            and cached[3] == _layout(ws))


def _dropper(runner_ref, slot):
    """The weakref callback that drops ``runner._fused[slot]`` once its weight is freed (holding the runner
    weakly: no reference cycle through its cache)."""
    def drop(_):
        runner = runner_ref()
        if runner is not None:
            runner._fused.pop(slot, None)
    return drop


def _plain_decode_shape(model) -> bool:
    """Whether every layer is what ``ModelRunner._decode_plan`` covers (its docstring)."""
    m = model.model
    if type(m.norm) is not RMSNorm or model.lm_head.bias is not None:
        return False
    for layer in m.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qk_ok = (type(attn.q_norm) is RMSNorm and type(attn.k_norm) is RMSNorm and attn.q_norm.eps == attn.k_norm.eps
                 and attn.q_norm.weight.dim() == 1) or _no_qk_norm(attn)
        if not (getattr(layer, "is_moe", True) and qk_ok and getattr(attn, "gate_proj", None) is None
                and type(layer.input_layernorm) is RMSNorm and type(layer.post_attention_layernorm) is RMSNorm
                and all(p.bias is None for p in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj))
                and mlp.shared_experts is None and not mlp.gate.sigmoid and hasattr(mlp, "experts")):
            return False
    return True


def _no_qk_norm(attn) -> bool:
    return isinstance(attn.q_norm, torch.nn.Identity) and isinstance(attn.k_norm, torch.nn.Identity)


def _check_batch_invariant(hybrid: bool, dtype: torch.dtype, cpp: bool) -> None:
    """A clear error where batch-invariant decoding cannot hold (``ModelRunner`` docstring)."""
    if hybrid:
        raise ValueError("rollout.batch_invariant supports full-attention models only (this model has kda / "
                         "gated_dsa layers, whose chunked prefill sums depend on the chunk)")
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"rollout.batch_invariant needs a float32 or float64 model (the C++ kernels), got {dtype}")
    if not cpp:
        raise ValueError("rollout.batch_invariant needs the C++ CPU kernels: model.kernels auto or cpu, on CPU")
    missing = [name for name, mod in (("kernels/paged_attention_cpu", paged_attention_cpu), ("kernels/moe_cpu", moe_cpu))
               if mod.load_kernel() is None]
    if missing:
        raise ValueError(f"rollout.batch_invariant needs the C++ CPU kernels, which did not build here: {missing}")
