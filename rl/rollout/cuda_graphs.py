"""``DecodeGraphs``: pure decode steps in CUDA graphs, one per bucket (batch size, table width), padded to it.

A decode step launches a few kernels per layer for a few rows each, so on a GPU the launches, not the
arithmetic, bound it; a CUDA graph replays a captured step's launches in one call. A graph fixes its
tensors' shapes and addresses, so each bucket (``BUCKETS``: 1, 2, 4, 8, then multiples of 8) owns static
input buffers -- next token, position, cache slot, block table [bucket, width], context length -- and the
logits its capture produced; a step of B sequences whose block tables are M wide copies its rows into the
smallest bucket ≥ B of the smallest power-of-two width ≥ M, at least ``MIN_WIDTH`` and at most
``max_blocks``, and replays. ``ModelRunner.decode_step`` is the captured function (tensors only: no host
sync, no value-dependent shape; on CUDA it needs the ``triton`` kernel table, whose MoE counts experts on the
device, ``kernels/moe_matmul._routed``, and not float64, which that table runs on the torch reference).

Padding rows repeat row 0's token, position, block table and context, so they read only row 0's keys, and
write their keys and values to the runner's scratch slot (``ModelRunner.scratch_slot``, one slot past the
blocks that no sequence owns), so a pad row never touches a real slot; their logits are dropped. A row's
result does not depend on the other rows where every kernel keeps a row's sums to itself (the ``cpu``
backend's packed projections, experts and paged attention), so padded and unpadded steps agree bit for bit
there (tested), and within float summation order elsewhere.

What a captured graph reads by address, and how it stays valid: the parameters (a push writes them in
place), the KV pool, the runner's derived copies (q|k|v concatenated, the q/k-norm table: ``ModelRunner.derived``),
the RoPE table (built once for every slot's position with ``decode_graphs``, ``ModelRunner._rope``) and the
MXFP4-resident experts (replaced by a push). ``LLMEngine.update_weights`` calls ``reset`` (every bucket's
graph and the memory pool dropped; the next step of a bucket captures again, reading the new weights), and
each bucket holds a reference to every runner-cache tensor and model buffer alive at its capture, so an eager
step that rebuilds a derived copy never frees memory a graph reads. Weights changed in place other than
through ``update_weights`` are not seen by graphs captured before: call ``reset``.

Cost: at most len(BUCKETS) × (log2(max_blocks / MIN_WIDTH) + 2) graphs (19 × 10 for 4096 blocks), each
captured at its first use (a warm-up call and a capture: tens of ms on a GPU); they share one memory pool,
whose size is the largest bucket's activations plus every graph's own ``slots_BS`` table [bucket, width ·
block_size] int64 (at 128 rows × 4096 blocks × 16: 64 MiB for the widest) and logits [bucket, V] (128 ×
151936 × 2 bytes: 37 MiB per bucket in bfloat16). The paged kernels take per-slot tables (``slots_BS``);
a block-table interface would make the width free and is not done.

On the host (no CUDA) the same padded static-buffer path runs eagerly -- what the CPU test checks --
and nothing is captured. A step over more than ``max_blocks`` blocks or more rows than the largest bucket
runs ``decode_step`` unpadded. On CUDA each bucket's graph is captured at its first use, after one eager warm-up
call on a side stream; the captures share one memory pool.
"""

from __future__ import annotations

import weakref

import torch

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120, 128)
MIN_WIDTH = 16  # blocks: every step over fewer shares one table width (the unread entries cost little)


class _Bucket:
    """One bucket's static buffers (and, on CUDA, its graph and the logits it writes)."""

    def __init__(self, size: int, max_blocks: int, device: torch.device) -> None:
        self.ids_B = torch.zeros(size, dtype=torch.long, device=device)
        self.pos_B = torch.zeros(size, dtype=torch.long, device=device)
        self.slot_B = torch.zeros(size, dtype=torch.long, device=device)
        self.table_BM = torch.zeros(size, max_blocks, dtype=torch.long, device=device)
        self.ctx_B = torch.ones(size, dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits_BV: torch.Tensor | None = None
        self.held: tuple = ()  # what the capture may read by address and the runner may drop (module docstring)

    def fill(self, ids_B, pos_B, slot_B, table_BM, ctx_B, scratch_slot: int) -> None:
        """The step's B rows first, then row 0's token, position, context and block table in every pad row,
        its cache slot ``scratch_slot``; the block table zero-padded to M columns."""
        B, M = table_BM.shape
        for buf, src in ((self.ids_B, ids_B), (self.pos_B, pos_B), (self.slot_B, slot_B), (self.ctx_B, ctx_B)):
            buf[:B].copy_(src)
            buf[B:].copy_(src[:1].expand(buf.shape[0] - B))
        self.slot_B[B:].fill_(scratch_slot)
        self.table_BM[:B, :M].copy_(table_BM)
        self.table_BM[:B, M:].zero_()
        self.table_BM[B:].copy_(self.table_BM[:1].expand(self.table_BM.shape[0] - B, -1))

    def inputs(self) -> tuple[torch.Tensor, ...]:
        return self.ids_B, self.pos_B, self.slot_B, self.table_BM, self.ctx_B


class DecodeGraphs:
    """Pure decode steps of ``runner`` (a ``ModelRunner``) through per-bucket static buffers; captured in CUDA
    graphs on a CUDA device, run eagerly on the host (module docstring)."""

    def __init__(self, runner, max_blocks: int, buckets: tuple[int, ...] = BUCKETS) -> None:
        if max_blocks < 1 or not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
            raise ValueError(f"max_blocks must be >= 1 and buckets increasing positive sizes, got {max_blocks}, {buckets}")
        # held weakly: the runner holds this (ModelRunner.graphs), and a cycle would keep its pools alive until
        # the cycle collector runs
        self.runner, self.max_blocks, self.buckets = weakref.proxy(runner), max_blocks, tuple(buckets)
        self.capture = runner.device.type == "cuda"
        if self.capture and (runner.kernels.backend != "triton" or runner.dtype == torch.float64):
            raise ValueError(f"decode graphs on CUDA need model.kernels triton and a bfloat16 / float16 / float32 "
                             f"model (ops without a host sync), got {runner.kernels.backend} and {runner.dtype}")
        self._buckets: dict[tuple[int, int], _Bucket] = {}  # (rows, table width) -> its buffers (and graph)
        self._pool = None  # the graphs' shared memory pool (CUDA)

    def reset(self) -> None:
        """Drop every bucket (buffers, graph, what it held) and the memory pool: the next step of each bucket
        captures again (``LLMEngine.update_weights`` after a push; module docstring)."""
        self._buckets.clear()
        self._pool = None

    def bucket_size(self, B: int) -> int | None:
        """The smallest bucket holding B rows, or None past the largest."""
        return next((b for b in self.buckets if b >= B), None)

    @torch.no_grad()
    def __call__(self, ids_B: torch.Tensor, pos_B: torch.Tensor, slot_B: torch.Tensor, table_BM: torch.Tensor,
                 ctx_B: torch.Tensor) -> torch.Tensor:
        """``runner.decode_step``'s arguments and result (logits [B, V]), through the bucket of B rows."""
        B, M = table_BM.shape
        size = self.bucket_size(B)
        if size is None or M > self.max_blocks:
            return self.runner.decode_step(ids_B, pos_B, slot_B, table_BM, ctx_B)
        width = min(max(1 << (M - 1).bit_length(), MIN_WIDTH), self.max_blocks)
        bucket = self._buckets.get((size, width))
        if bucket is None:
            bucket = self._buckets[size, width] = _Bucket(size, width, self.runner.device)
        bucket.fill(ids_B, pos_B, slot_B, table_BM, ctx_B, self.runner.scratch_slot)
        if not self.capture:
            return self.runner.decode_step(*bucket.inputs())[:B]
        if bucket.graph is None:
            self._capture(bucket)
        bucket.graph.replay()
        return bucket.logits_BV[:B]

    def _capture(self, bucket: _Bucket) -> None:
        """Warm up on a side stream (kernels chosen and compiled, the derived copies built), then capture, and
        hold what the capture read of the runner's caches and the model's buffers. The warm-up writes the
        bucket's current rows' keys/values as the replay after it will: the same bytes."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.runner.decode_step(*bucket.inputs())
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            bucket.logits_BV = self.runner.decode_step(*bucket.inputs())
        self._pool = graph.pool()
        runner = self.runner
        bucket.held = (tuple(entry[1] for entry in runner._fused.values()), runner._rope_table,
                       tuple(runner.model.buffers()))
        bucket.graph = graph
