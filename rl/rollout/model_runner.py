"""``ModelRunner``: one forward of the model over a flat, ragged batch with a paged KV cache.

Kernels: the model's kernel table (``model.kernels``, ``kernels/ops.Kernels``), chosen when the model was
built; the C++ paths below run on the ``cpu`` backend only (``Kernels.cpp``), the torch references or the
Triton kernels otherwise. Measurements behind the choices below: tests/bench/results.md, "ModelRunner".

Every model runs one loop over its layers, each layer's ``paged`` (``DecoderLayer.paged``, ``model/paged.py``:
the layer kind's own modules, weights and kernel choices; the runner hands it a ``_Step``: the step's rows, how
they attend, its pools and packer), so the runner holds no layer's internals and does not branch on kinds. All
new tokens of a step -- one per decoding sequence, a chunk per prefilling one -- are flattened to N rows; the
norms, FFN / MoE and head run once over all N. A token mixer with a ragged form (``StateSpec.ragged``: plain
full attention, gpt-oss's with sinks and a window) runs over all N too; any other kind (KDA, gated DSA, MLA, a
new one) runs its own ``forward`` per sequence group over the model's ``AttentionState`` hook (``_groups``:
every decoding sequence in one ``DecodeBatchState``, each other chunk with its ``PagedState``; each kind brings
its state, declared by its ``StateSpec``). On the ragged rows every projection and the MoE (tokens grouped by expert, one matmul per active
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
prepared weights (``_decode_plan``, a ``model.paged.LayerPlan`` per layer, built by ``model.paged``: no module
lookups, cache checks or wrappers per layer, one ``decode_layer`` C++ call each; bit for bit the general path). Attention then reads each sequence's keys/values
through its block table, in place: the decoding rows in one paged-decode call, all the step's prefill
chunks in one paged-prefill call.

Cache layout: ``kv_LPCHD`` [layers, num_blocks·block_size + 1 slots, 2 (k, v), kv heads, D];
block b holds slots [b·bs, (b+1)·bs); the last slot (``scratch_slot``) belongs to no block: a padded
decode step's pad rows write there (``cuda_graphs``). Keys are stored after q/k-norm and RoPE. Decode
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

import functools
import weakref

import torch
import torch.nn.functional as F

from jointrl.kernels import decode_cpu, linear_cpu, moe_cpu, paged_attention_cpu
from jointrl.kernels.cpu_extension import zeros_huge_pages
from jointrl.model import MoETransformer, paged
from jointrl.model.attention import AttentionBatch
from jointrl.model.paged import DecodePlan
from jointrl.rl.rollout.cuda_graphs import DecodeGraphs
from jointrl.rl.image_inputs import slot_patches
from jointrl.rl.rollout.paged_state import DecodeBatchState, PagedState
from jointrl.rl.rollout.sequence import Sequence

ROW_TILE = 16  # batch_invariant: rows per GEMM call (a fixed shape, so a fixed summation order per row)
SHORT_PREFILL = 16  # prefill chunks of at most this many tokens attend as decode rows (``run``)


class ModelRunner:
    def __init__(self, model: MoETransformer, num_blocks: int, block_size: int, batch_invariant: bool = False,
                 kv_dtype: torch.dtype | None = None, decode_graphs: bool = False) -> None:
        """``decode_graphs``: pure decode steps through ``cuda_graphs.DecodeGraphs`` (CUDA graphs on a GPU, the
        same padded static buffers eagerly on the host); full-attention (ragged) models, not with
        ``batch_invariant``; the RoPE table is then built once here for every slot's position (``_rope``)."""
        cfg = model.config
        mixers = [layer.self_attn for layer in model.model.layers]
        specs = [mixer.state_spec for mixer in mixers]  # what each layer keeps per sequence (model.state.StateSpec)
        # every layer of a kind that runs on a ragged batch (StateSpec.ragged: its ``paged``, model/paged.py): one
        # loop over the layers on all of a step's rows; a model with any other kind runs through its own forward
        # over PagedState, whatever state its layers declare
        self.hybrid = not all(spec.ragged for spec in specs)
        self.prefix_cacheable = not any(spec.fixed for spec in specs)  # a fixed-size state is not per block
        self.invariant = batch_invariant
        if batch_invariant:
            # sinks / a sliding window (gpt-oss) run the torch references, which promise no batch invariance
            sinks = any(getattr(m, "sinks", None) is not None or getattr(m, "window", None) is not None for m in mixers)
            _check_batch_invariant(self.hybrid, next(model.parameters()).dtype, model.kernels.cpp, sinks)
        self.model, self.bs = model, block_size
        self.kernels = model.kernels  # the model's kernel backend (model.kernels), chosen when it was built
        self.dtype = next(model.parameters()).dtype
        self.kv_dtype = kv_dtype or self.dtype  # the cache's dtype (module docstring: bfloat16 cache)
        if self.kv_dtype != self.dtype and (self.hybrid or (self.dtype, self.kv_dtype) != (torch.float32, torch.bfloat16)):
            raise ValueError(f"rollout.kv_dtype={self.kv_dtype} needs a float32 model with full-attention layers only "
                             f"(this one: {self.dtype}, hybrid={self.hybrid}); use auto (the model's dtype)")
        self.Hq, self.Hkv, self.D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        P = num_blocks * block_size
        # one slot past the blocks that no sequence owns: DecodeGraphs' pad rows write their keys/values there
        self.scratch_slot = P
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
        kv_shape = (len(kv_layers), P + 1, 2, self.Hkv, self.D)
        self.kv_LPCHD = (zeros_huge_pages(kv_shape, self.kv_dtype) if self.device.type == "cpu"
                         else torch.zeros(kv_shape, dtype=self.kv_dtype, device=self.device))
        self.index_LPD = torch.zeros(len(index_layers), P, max(index_dims, default=1), dtype=self.dtype,
                                     device=self.device)
        self.latent_LPD = torch.zeros(len(latent_layers), P, max(latent_dims, default=1), dtype=self.dtype,
                                      device=self.device)
        self._fused: dict = {}  # packed / derived weights: _packed_weight, _packed_experts, derived
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # (cos_PD, sin_PD) by position
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
        # the routed experts' buffer tables: experts held MXFP4-resident (Experts.load_mxfp4) run through their
        # kernel table, not a plan over the dense parameters (_decode_plan)
        self._expert_buffers = [ex._buffers for layer in model.model.layers
                                if isinstance(ex := getattr(layer.mlp, "experts", None), torch.nn.Module)]
        if decode_graphs and (self.hybrid or self.invariant):
            raise ValueError("decode graphs need a model whose layers all run on a ragged batch, without batch_invariant")
        if decode_graphs and not all(getattr(getattr(layer.mlp, "experts", None), "plain_swiglu", True)
                                     for layer in model.model.layers):  # capturable: the table's sync-free MoE op
            raise ValueError("decode graphs need plain SwiGLU experts (model.moe.Experts: the kernel table's sync-free "
                             "moe_experts); this model's are not (e.g. gpt-oss's clamped, biased experts)")
        self.graphs = DecodeGraphs(self, max_blocks=num_blocks) if decode_graphs else None
        if decode_graphs:  # captured graphs index the table by address: built once, never rebuilt (_rope)
            self._rope_table = paged.rope_table(self.model, P, self.dtype, self.device)

    def derived(self, ws: tuple[torch.Tensor, ...], fn) -> torch.Tensor:
        """``fn(*ws)`` (e.g. q, k, v as one [(Hq + 2·Hkv)·D, H] weight: one matmul instead of three), rebuilt when
        any of ``ws`` changes: ``update_weights`` copies in place, which bumps a tensor's version counter; a
        replaced parameter has a new address and object (weak references, as ``_packed_weight``'s). Keyed by
        ``id(ws[0])``, dropped when it is freed."""
        slot = id(ws[0])
        key = tuple((w.data_ptr(), w._version) for w in ws)
        cached = self._fused.get(slot)
        if cached is None or cached[0] != key or any(r() is not w for r, w in zip(cached[2], ws)):
            refs = (weakref.ref(ws[0], _dropper(weakref.ref(self), slot)), *map(weakref.ref, ws[1:]))
            cached = self._fused[slot] = (key, fn(*ws), refs)
        return cached[1]

    def _packed(self, x_NK: torch.Tensor, *ws: torch.Tensor) -> torch.Tensor:
        """x_NK @ cat(ws).T for bias-free projections through ``kernels/linear_cpu``."""
        return linear_cpu.linear(x_NK, *self._packed_weight(*ws))

    def _packed_weight(self, *ws: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(``linear_cpu.pack(cat(ws))``, its output count), cached and rebuilt like ``derived``'s when
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
        last ulp) and doubled when a position passes it -- one index per step instead of ~10 ops. With decode
        graphs the table covers every slot's position from construction and is not rebuilt (captured graphs read
        it by address); should it be (another dtype), the graphs are dropped first (``DecodeGraphs.reset``)."""
        table = self._rope_table
        if table is None or table[0].shape[0] < need or table[0].dtype != dtype:
            size = max(1024, 1 << (need - 1).bit_length())
            if self.graphs is not None:
                self.graphs.reset()
                size = max(size, self.scratch_slot)
            table = self._rope_table = paged.rope_table(self.model, size, dtype, self.device)
        return table[0][pos_N], table[1][pos_N]

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

        if self.graphs is not None and not prefill and self.image is None and not want_routed:  # a pure decode step
            logits_NV = self.graphs(ids_N, pos_N, slot_N, table_BM, ctx_B)  # rows in batch order (every n is 1)
            ends = [i for i, (seq, n) in enumerate(batch) if seq.num_computed + n == len(seq)]
            return (logits_NV[ends] if len(ends) < len(batch) else logits_NV), ends, None
        m = self.model
        images = self.image is not None and bool((ids_N == self.image[0]).any())
        x_NH = paged.embed(m, ids_N, self._patches([batch[i] for i in order]) if images else None)
        cos_ND, sin_ND = self._rope(pos_N, n_pos, x_NH.dtype)
        if self.packed_linear and not prefill and self.image is None:
            plan = self._decode_plan()
            if plan is not None:
                return self._decode_planned(plan, x_NH, cos_ND, sin_ND, slot_N, dec_slots_BS, ctx_B, batch, want_routed)
        if rows_as_decode:
            attend = functools.partial(_paged_decode, self.kernels.paged_decode, all_slots_NS, all_ctx_N, self.D ** -0.5)
        else:
            attend = functools.partial(self._attention, n_dec=n_dec, dec_slots_BS=dec_slots_BS, ctx_B=ctx_B, chunks=chunks)
        step = _Step(self, cos_ND, sin_ND, slot_N, attend)
        if self.hybrid:  # kinds without a ragged form run per sequence group, over the model's AttentionState hook
            step.per_sequence = functools.partial(_per_sequence, self._groups(batch, order, n_dec, first_row, x_NH.dtype))
        routed = []
        for layer in m.model.layers:  # each layer kind's ``paged`` (model/paged.py), over all the step's rows
            x_NH, ids_Nk = layer.paged(x_NH, step)
            if want_routed and ids_Nk is not None:
                routed.append(ids_Nk)

        ends = [i for i, (seq, n) in enumerate(batch) if seq.num_computed + n == len(seq)]
        logits_RV = paged.head(m, x_NH[[first_row[i] + batch[i][1] - 1 for i in ends]], step)
        routed_NLk = None
        if want_routed:  # back to batch order
            rows = torch.tensor([r for i, (_, n) in enumerate(batch) for r in range(first_row[i], first_row[i] + n)],
                                dtype=torch.long, device=self.device)
            routed_NLk = torch.stack(routed, dim=1)[rows]
        return logits_RV, ends, routed_NLk

    @torch.no_grad()
    def decode_step(self, ids_B: torch.Tensor, pos_B: torch.Tensor, slot_B: torch.Tensor, table_BM: torch.Tensor,
                    ctx_B: torch.Tensor) -> torch.Tensor:
        """One pure decode step from tensors only → logits [B, V]; the new keys/values written to the cache.

        ids_B, pos_B [B] int64: each sequence's next token and its position; slot_B [B]: the cache slot it is
        written to; table_BM [B, M] int64: block tables, zero-padded to M blocks (M·block_size ≥ every
        context); ctx_B [B] = pos_B + 1. All on the runner's device. No host sync and no shape that depends on
        the values (the sequences' keys read through ``slots_BS`` [B, M·block_size], entries past ctx unread;
        the MoE's experts through the kernel table, whose ``triton`` form counts them on the device,
        ``kernels/moe_matmul._routed``), so a CUDA graph can capture it for fixed B and M on the ``triton``
        table (``cuda_graphs.DecodeGraphs``; the ``torch`` reference and the ``cpu`` C++ loop sync, which only
        matters on a GPU). The RoPE table must cover M·block_size positions before a capture (built at
        construction with ``decode_graphs``). Full-attention (ragged) models only; the same rows as ``run``'s
        decode, up to the attention's float summation order where the slot tables differ (bit for bit on the
        ``cpu`` backend)."""
        if self.hybrid:
            raise ValueError("decode_step needs a model whose layers all run on a ragged batch (StateSpec.ragged)")
        B, M = table_BM.shape
        S = M * self.bs
        slots_BS = (table_BM[:, :, None] * self.bs + torch.arange(self.bs, device=table_BM.device)).view(B, S)
        x_NH = paged.embed(self.model, ids_B)
        cos_ND, sin_ND = self._rope(pos_B, S, x_NH.dtype)
        plan = self._decode_plan() if self.packed_linear and self.image is None else None
        if plan is not None:
            paged.decode_layers(plan, x_NH, cos_ND, sin_ND, slot_B, slots_BS, ctx_B, self.D ** -0.5, self.Hq,
                                self.Hkv, False)
            return paged.decode_head(plan, x_NH)
        step = _Step(self, cos_ND, sin_ND, slot_B,
                     functools.partial(_paged_decode, self.kernels.paged_decode, slots_BS, ctx_B, self.D ** -0.5))
        for layer in self.model.model.layers:
            x_NH, _ = layer.paged(x_NH, step)
        return paged.head(self.model, x_NH, step)

    def _decode_plan(self) -> DecodePlan | None:
        """What a pure decode step calls per layer, the weights packed and fused (``model.paged.decode_plan``: a
        ``LayerPlan`` per layer, the final norm and head); None unless every layer has the plain shape the C++
        path covers (``model.paged.plain_decode_shape``; a bfloat16 cache too: the same calls take it) and no
        layer holds its experts MXFP4-resident (their kernel reads those, not the dense parameters). Rebuilt
        when any weight changes in place (its version) or is replaced (its address), like ``derived``."""
        params = self._plan_params()
        if params is None or any(b.get("mxfp4_gate_up_blocks") is not None for b in self._expert_buffers):
            return None
        key = tuple((p.data_ptr(), p._version) for p in params)
        if self._plan is not None and self._plan[0] == key:
            return self._plan[1]
        plan = paged.decode_plan(self.model, _Step(self))
        self._plan = (key, plan)
        return plan

    def _plan_params(self) -> list[torch.Tensor] | None:
        """The parameters ``_decode_plan`` reads, looked up in their modules' parameter tables
        (``model.paged.plan_refs``, decided once), or None when a layer is not of the plan's shape."""
        if self._plan_refs is None:
            self._plan_refs = paged.plan_refs(self.model)
        return [table[name] for table, name in self._plan_refs] if self._plan_refs else None

    def _decode_planned(self, plan, x_NH, cos_ND, sin_ND, slot_N, slots_BS, ctx_B, batch, want_routed
                        ) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
        """``run``'s layers for a pure decode step (every row one sequence's next token, in batch order): the
        plan's layers, one C++ call each (``model.paged.decode_layers``), the residual adds in place."""
        N = x_NH.shape[0]
        routed = paged.decode_layers(plan, x_NH, cos_ND, sin_ND, slot_N, slots_BS.contiguous(), ctx_B.contiguous(),
                                     self.D ** -0.5, self.Hq, self.Hkv, want_routed)
        ends = [i for i, (seq, n) in enumerate(batch) if seq.num_computed + n == len(seq)]
        if len(ends) < N:  # a prompt's chunk cut to one token by the step's budget: no logits for it
            x_NH = x_NH[ends]
        return paged.decode_head(plan, x_NH), ends, torch.stack(routed, dim=1) if want_routed else None

    def _attention(self, q_NHD, kv_PCHD, sinks_H=None, window=None, *, n_dec, dec_slots_BS, ctx_B, chunks
                   ) -> torch.Tensor:
        """The decoding rows in one paged-decode call, all prefill chunks -- ``chunks`` = (slots_CS, start_C,
        row0_C, count_C), or None -- in one paged-prefill call (each chunk's keys read in place; SDPA per chunk
        where the kernel does not apply); the layer's attention sinks and sliding window passed on."""
        if chunks is None:  # a pure decode step: the kernel's output is the whole output
            return self.kernels.paged_decode(q_NHD, kv_PCHD, dec_slots_BS, ctx_B, self.D ** -0.5, sinks_H, window)
        out_NHD = torch.empty_like(q_NHD)
        if n_dec:
            out_NHD[:n_dec] = self.kernels.paged_decode(q_NHD[:n_dec], kv_PCHD, dec_slots_BS, ctx_B, self.D ** -0.5,
                                                        sinks_H, window)
        return self.kernels.paged_prefill(q_NHD, kv_PCHD, *chunks, self.D ** -0.5, out_NHD, sinks_H, window)

    def _rows(self, fn, x_NH: torch.Tensor) -> torch.Tensor:
        """``fn`` (row-wise: [n, in] -> [n, out]) over the rows of ``x_NH``; batch-invariant: one call per
        tile of exactly ``ROW_TILE`` rows."""
        if not self.invariant:
            return fn(x_NH)
        N = x_NH.shape[0]
        tiles = F.pad(x_NH, (0, 0, 0, -N % ROW_TILE)).split(ROW_TILE)
        return torch.cat([fn(t) for t in tiles])[:N] if N else fn(x_NH)

    def _tiles(self, x_NH: torch.Tensor) -> list[torch.Tensor]:
        """The row tiles of ``_rows``: [x_NH], or batch-invariant: tiles of exactly ``ROW_TILE`` rows."""
        if not self.invariant:
            return [x_NH]
        return list(F.pad(x_NH, (0, 0, 0, -x_NH.shape[0] % ROW_TILE)).split(ROW_TILE))

    def _groups(self, batch, order, n_dec, first_row, dtype) -> list[tuple[torch.Tensor, int, AttentionBatch]]:
        """The step's rows as the forwards of the model's layers without a ragged form take them, each with its
        ``AttentionBatch`` over the paged pools: every decoding sequence (one new token, past its first) in one
        batch (``DecodeBatchState``: keys gathered left-padded and masked, fixed-size states stacked), every
        other sequence's chunk alone (``PagedState``) → [(rows [B·T] in the step's row order, T, batch)]."""
        m, dev, groups = self.model, self.device, []
        decoding = [i for i in order[:n_dec] if batch[i][0].num_computed > 0]
        if len(decoding) > 1:
            state = DecodeBatchState(self, [batch[i][0] for i in decoding])
            key_mask_BS = state.attention_mask_BS
            groups.append((torch.tensor([first_row[i] for i in decoding], device=dev), 1, m.attention_batch(
                state.position_ids_B1, dtype, mask_B1TS=None, token_mask_BT=key_mask_BS[:, state.length:], cache=state,
                past=state.length, key_mask_BS=key_mask_BS)))
        for i in order:
            if len(decoding) > 1 and i in decoding:
                continue
            seq, n = batch[i]
            c = seq.num_computed
            groups.append((torch.arange(first_row[i], first_row[i] + n, device=dev), n, m.attention_batch(
                torch.arange(c, c + n, device=dev)[None], dtype, mask_B1TS=None, token_mask_BT=None,
                cache=PagedState(self, seq, n), past=c)))
        return groups

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


class _Step:
    """``model.paged.PagedStep`` of one ``ModelRunner.run`` step: the runner's choices, packer and pools, the
    step's RoPE rows and slots, and how its rows attend (``attend``: bound once per step, no branch per layer).
    Without the step's rows (``_decode_plan``) only the packer and pools are read."""

    __slots__ = ("fast", "packed_linear", "kv_dtype", "cos_ND", "sin_ND", "slot_N", "attend", "rows", "tiles",
                 "linear", "packed_weight", "packed_experts", "derived", "per_sequence", "_pools", "_index")

    def __init__(self, runner: ModelRunner, cos_ND=None, sin_ND=None, slot_N=None, attend=None) -> None:
        self.fast, self.packed_linear, self.kv_dtype = runner.fast, runner.packed_linear, runner.kv_dtype
        self.cos_ND, self.sin_ND, self.slot_N, self.attend = cos_ND, sin_ND, slot_N, attend
        self.rows, self.tiles, self.linear = runner._rows, runner._tiles, runner._packed
        self.packed_weight, self.packed_experts, self.derived = runner._packed_weight, runner._packed_experts, runner.derived
        self._pools, self._index = runner.kv_LPCHD, runner.pool_index
        self.per_sequence = None  # run: set where a layer kind has no ragged form

    def kv(self, layer: int) -> torch.Tensor:
        return self._pools[self._index[layer]]


def _per_sequence(groups, mixer, h_NH: torch.Tensor) -> torch.Tensor:
    """``mixer``'s own forward (a layer kind without a ragged form) over each of ``ModelRunner._groups`` → y_NH."""
    y_NH = torch.empty_like(h_NH)
    for rows, T, attention_batch in groups:
        y_NH.index_copy_(0, rows, mixer(h_NH.index_select(0, rows).view(-1, T, h_NH.shape[1]), attention_batch).flatten(0, 1))
    return y_NH


def _paged_decode(op, slots_NS, ctx_N, scale, q_NHD, kv_PCHD, sinks_H=None, window=None) -> torch.Tensor:
    """Every row a decode query over its keys 0..pos (``run``'s rows-as-decode steps)."""
    return op(q_NHD, kv_PCHD, slots_NS, ctx_N, scale, sinks_H, window)


def _check_batch_invariant(hybrid: bool, dtype: torch.dtype, cpp: bool, sinks: bool = False) -> None:
    """A clear error where batch-invariant decoding cannot hold (``ModelRunner`` docstring)."""
    if hybrid:
        raise ValueError("rollout.batch_invariant supports full-attention models only (this model has kda / "
                         "gated_dsa layers, whose chunked prefill sums depend on the chunk)")
    if sinks:
        raise ValueError("rollout.batch_invariant needs the C++ paged attention kernels, which have no attention "
                         "sinks or sliding window (this model's, e.g. gpt-oss's, run the torch reference)")
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"rollout.batch_invariant needs a float32 or float64 model (the C++ kernels), got {dtype}")
    if not cpp:
        raise ValueError("rollout.batch_invariant needs the C++ CPU kernels: model.kernels auto or cpu, on CPU")
    missing = [name for name, mod in (("kernels/paged_attention_cpu", paged_attention_cpu), ("kernels/moe_cpu", moe_cpu))
               if mod.load_kernel() is None]
    if missing:
        raise ValueError(f"rollout.batch_invariant needs the C++ CPU kernels, which did not build here: {missing}")
