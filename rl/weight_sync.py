"""Learner -> rollout weight push: bucketed, versioned, checksummed; routed experts in MXFP4.

Sender (a learner rank)::

    for bucket in iter_buckets(model.state_dict(), version):   # bounded memory per bucket
        ray.get([w.apply_bucket.remote(bucket) for w in rollout_workers])

or ``build_bundle(...)`` for the whole push as one ``WeightBundle``. With expert parallelism
each rank passes the state dict of what it sends (rank 0: the shared parameters and its
experts; every expert-parallel rank: its slice of each layer's experts) with ``row_offsets``
giving the first expert of each slice: bundles may be partial, an entry with a row offset
writes ``target[offset : offset + rows]``, and the receiver only writes what a bundle names.

What travels. Tensors selected by ``is_quantized(name, tensor)`` (default
``is_routed_expert``: stacked routed-expert weights such as
``model.layers.0.mlp.experts.gate_up_proj [E, 2I, H]`` / ``...down_proj [E, H, I]``) are
MXFP4-quantized along their last (reduction) dim with ``kernels.mxfp4``; the rule that made
them is recorded per entry. Everything else (attention, router, norms, embeddings, head)
travels dense, in ``dense_dtype`` (default: unchanged). Experts are quantized where the weights
are (the Triton kernel on a GPU, C++ on the host). All payload tensors are copies on the bucket's
``device`` (default: where each weight is; ``build_bundle``: the host, for Ray's object store),
taken when the bucket is built, so a learner step afterwards cannot change a bucket in flight.

Integrity. Each entry carries a 64-bit XXH3 digest (``xxhash``) of its payload bytes; each bucket
an XXH3 digest of its version, index and every entry's metadata and payload digest; the bundle
its total payload bytes. The receiver checks all of it, plus name, shape and version, before it
writes anything, and names the offending tensor in a ``ValueError``. XXH3 catches transport
corruption, not tampering (a non-cryptographic hash; ~4x faster here than ``zlib.crc32``, which
took about two thirds of a bench_moe fp32 push, sender and receiver together).

Receiver. ``apply_bundle`` / ``apply_bucket`` dequantize MXFP4 entries on the target's
device to the target's dtype and ``copy_`` every entry in place under ``torch.no_grad()``.
Dense entries whose transfer dtype equals the target's land bit for bit; MXFP4 entries land
as ``mxfp4_roundtrip`` of the learner's tensor.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch
import xxhash
from torch import Tensor, nn

from jointrl.kernels.mxfp4 import ScaleRule, dequantize_mxfp4, quantize_mxfp4
from jointrl.rl.device import HOST

__all__ = [
    "EntryKind",
    "WeightBucket",
    "WeightBundle",
    "WeightEntry",
    "apply_bucket",
    "apply_bundle",
    "build_bundle",
    "is_routed_expert",
    "iter_buckets",
    "hold_mxfp4_experts",
    "merge_bundles",
]

DEFAULT_BUCKET_BYTES = 32 << 20


class EntryKind(enum.StrEnum):
    DENSE = "dense"
    MXFP4 = "mxfp4"


@dataclass(frozen=True, slots=True)
class WeightEntry:
    """One named tensor in transit.

    ``shape``/``dtype`` are the learner tensor's. DENSE: ``data`` is the tensor itself
    (transfer dtype), ``scales`` is None, ``scale_rule`` is None. MXFP4: ``data`` is
    ``blocks uint8 [..., K/2]``, ``scales`` is ``uint8 [..., K/32]`` for ``shape = [..., K]``.
    ``checksum`` is the XXH3-64 of ``data``'s bytes, chained (as the seed) into ``scales``' bytes'.
    """

    name: str
    kind: EntryKind
    shape: tuple[int, ...]
    dtype: torch.dtype
    scale_rule: ScaleRule | None
    data: Tensor
    scales: Tensor | None
    checksum: int
    row_offset: int | None = None  # the entry is target[row_offset : row_offset + shape[0]] (expert slices)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.data) + (0 if self.scales is None else _nbytes(self.scales))

    def describe(self) -> str:
        """Metadata line the bucket checksum covers (payload enters through ``checksum``)."""
        scales = None if self.scales is None else (tuple(self.scales.shape), self.scales.dtype)
        return (
            f"{self.name}|{self.kind}|{self.shape}|{self.dtype}|{self.scale_rule}|"
            f"{tuple(self.data.shape)}|{self.data.dtype}|{scales}|{self.checksum}|{self.row_offset}"
        )


@dataclass(frozen=True, slots=True)
class WeightBucket:
    """A bounded group of entries: the unit a sender streams. ``index`` counts from 0 per push."""

    version: int
    index: int
    entries: tuple[WeightEntry, ...]
    checksum: int

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]


@dataclass(frozen=True, slots=True)
class WeightBundle:
    """One whole push: policy ``version``, its buckets in order, and their total payload bytes."""

    version: int
    buckets: tuple[WeightBucket, ...]
    total_bytes: int


def is_routed_expert(name: str, tensor: Tensor | None = None) -> bool:
    """Default ``is_quantized``: routed-expert weight matrices (``.mlp.experts.`` in the name).

    Shared experts (``.mlp.shared_experts.``), the router (``.mlp.gate.``) and any expert bias
    or 1-D tensor stay dense.
    """
    if ".mlp.experts." not in name or name.endswith("bias"):
        return False
    return tensor is None or (tensor.is_floating_point() and tensor.dim() >= 2)


# ---------------------------------------------------------------------------------------
# sender
# ---------------------------------------------------------------------------------------


def iter_buckets(
    state_dict: Mapping[str, Tensor],
    version: int,
    is_quantized: Callable[[str, Tensor], bool] = is_routed_expert,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    scale_rule: str = "floor",
    *,
    dense_dtype: torch.dtype | None = None,
    row_offsets: Mapping[str, int] | None = None,
    device: torch.device | None = None,
) -> Iterator[WeightBucket]:
    """Yield the push as buckets, in ``state_dict`` order, each built only when asked for.

    A bucket holds entries while their payload fits in ``bucket_bytes``; an entry larger
    than the bound gets a bucket of its own. Peak extra memory is about one bucket plus one
    entry.

    Args:
        state_dict: name -> tensor (any device). Quantized tensors have shape ``[..., K]``
            with ``K % 32 == 0``.
        version: policy version of these weights (>= 0).
        is_quantized: which tensors travel as MXFP4 (default ``is_routed_expert``).
        bucket_bytes: payload bound per bucket (> 0).
        scale_rule: MXFP4 scale rule, ``"floor"`` or ``"ceil"``.
        dense_dtype: transfer dtype for floating dense tensors (None: keep each dtype).
        row_offsets: name -> first row in the receiver's tensor, for tensors that are a slice
            along dim 0 (an expert-parallel rank's experts); others are whole tensors.
        device: where the payloads are put (None: each weight's own device; quantizing always
            runs there).

    Raises:
        ValueError: bad ``version``/``bucket_bytes``/``scale_rule``, or a quantized tensor
            whose last dim is not a multiple of 32 (named).
    """
    if version < 0:
        raise ValueError(f"version must be >= 0, got {version}")
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    if scale_rule not in tuple(ScaleRule):
        raise ValueError(f"scale_rule must be one of {[r.value for r in ScaleRule]}, got {scale_rule!r}")
    rule = ScaleRule(scale_rule)

    pending: list[WeightEntry] = []
    pending_bytes = 0
    index = 0
    for name, tensor in state_dict.items():
        entry = _make_entry(name, tensor, is_quantized(name, tensor), rule, dense_dtype, device)
        if row_offsets and name in row_offsets:
            entry = dataclasses.replace(entry, row_offset=int(row_offsets[name]))
        if pending and pending_bytes + entry.nbytes > bucket_bytes:
            yield _make_bucket(version, index, pending)
            index += 1
            pending, pending_bytes = [], 0
        pending.append(entry)
        pending_bytes += entry.nbytes
    if pending:
        yield _make_bucket(version, index, pending)


def build_bundle(
    state_dict: Mapping[str, Tensor],
    version: int,
    is_quantized: Callable[[str, Tensor], bool] = is_routed_expert,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    scale_rule: str = "floor",
    *,
    dense_dtype: torch.dtype | None = None,
    row_offsets: Mapping[str, int] | None = None,
    device: torch.device | None = HOST,
) -> WeightBundle:
    """The whole push as one ``WeightBundle`` (arguments as ``iter_buckets``), by default of host
    tensors: what Ray's object store carries. ``device=None`` keeps each payload where its weight
    is (a colocated push within one process: ``rl/colocate.py``)."""
    buckets = tuple(
        iter_buckets(state_dict, version, is_quantized, bucket_bytes, scale_rule, dense_dtype=dense_dtype,
                     row_offsets=row_offsets, device=device)
    )
    return WeightBundle(version=version, buckets=buckets, total_bytes=sum(b.nbytes for b in buckets))


def _make_entry(
    name: str, tensor: Tensor, quantize: bool, rule: ScaleRule, dense_dtype: torch.dtype | None,
    device: torch.device | None,
) -> WeightEntry:
    tensor = tensor.detach()
    device = tensor.device if device is None else device
    if quantize:
        if tensor.dim() == 0 or tensor.shape[-1] % 32 != 0:
            raise ValueError(
                f"tensor {name!r} of shape {tuple(tensor.shape)} is selected for MXFP4 but its "
                f"last dim is not a multiple of 32"
            )
        blocks, scales = quantize_mxfp4(tensor, rule)
        blocks, scales = blocks.to(device), scales.to(device)
        return WeightEntry(
            name=name, kind=EntryKind.MXFP4, shape=tuple(tensor.shape), dtype=tensor.dtype,
            scale_rule=rule, data=blocks, scales=scales, checksum=_digest(scales, _digest(blocks)),
        )
    dtype = dense_dtype if dense_dtype is not None and tensor.is_floating_point() else tensor.dtype
    data = tensor.to(device=device, dtype=dtype, copy=True, memory_format=torch.contiguous_format)
    return WeightEntry(
        name=name, kind=EntryKind.DENSE, shape=tuple(tensor.shape), dtype=tensor.dtype,
        scale_rule=None, data=data, scales=None, checksum=_digest(data),
    )


def _make_bucket(version: int, index: int, entries: list[WeightEntry]) -> WeightBucket:
    entries_t = tuple(entries)
    return WeightBucket(version, index, entries_t, _bucket_checksum(version, index, entries_t))


# ---------------------------------------------------------------------------------------
# receiver
# ---------------------------------------------------------------------------------------


def apply_bundle(
    model_or_state: nn.Module | Mapping[str, Tensor],
    bundle: WeightBundle,
    expected_version: int | None = None,
    dtype: torch.dtype | None = None,
    *,
    current_version: int | None = None,
) -> None:
    """Verify a whole bundle, then write it into ``model_or_state`` in place.

    Nothing is written unless every check passes: bucket order and version, bucket and
    entry checksums, total bytes, every name present in the receiver with the same shape.

    Args:
        model_or_state: the receiving ``nn.Module`` (its ``state_dict`` names: parameters and
            persistent buffers) or a name -> tensor mapping whose tensors are written.
        bundle: from ``build_bundle``.
        expected_version: if given, ``bundle.version`` must equal it.
        dtype: dequantize MXFP4 entries in this dtype (None: each target's own dtype).
        current_version: the receiver's version; if given, ``bundle.version`` must exceed it.

    Raises:
        ValueError: any failed check, naming the tensor (or bucket) at fault.
    """
    _check_version(bundle.version, expected_version, current_version)
    _check_bundle(bundle)
    targets = _targets(model_or_state)
    _write([p for bucket in bundle.buckets for p in _plan(bucket, targets)], dtype)


@torch.no_grad()
def hold_mxfp4_experts(model: nn.Module, bundle: WeightBundle) -> int:
    """After ``apply_bundle(model, bundle)``: keep the routed experts the bundle carries as MXFP4 resident
    in that form (``model/moe.Experts.load_mxfp4``), so a backend with an MXFP4 MoE kernel (``triton``)
    reads the pushed blocks and scales instead of the dequantized copy. Per experts module (one that has
    ``load_mxfp4``), from what this bundle names of its ``gate_up_proj`` / ``down_proj``:

    * both whole, as MXFP4 -> held (replacing an older pair);
    * row slices (an expert-parallel rank's experts), as MXFP4, into a module already holding a pair ->
      written into those rows of the held blocks and scales;
    * any of them dense, or slices into a module holding nothing -> the module drops / keeps no MXFP4
      pair and reads its dense parameters (which ``apply_bundle`` just wrote): never a stale pair.

    Run only on a bundle ``apply_bundle`` accepted (its checks are not repeated). → modules holding MXFP4."""
    by_module: dict[str, dict[str, list[WeightEntry]]] = {}
    for bucket in bundle.buckets:
        for entry in bucket.entries:
            path, _, leaf = entry.name.rpartition(".")
            if leaf in ("gate_up_proj", "down_proj"):
                by_module.setdefault(path, {}).setdefault(leaf, []).append(entry)
    held = 0
    for path, parts in by_module.items():
        experts = model.get_submodule(path)
        if not hasattr(experts, "load_mxfp4"):
            continue
        entries = [e for es in parts.values() for e in es]
        holding = getattr(experts, "mxfp4_gate_up_blocks", None) is not None
        if any(e.kind != EntryKind.MXFP4 for e in entries):
            experts.drop_mxfp4()
        elif len(parts) == 2 and all(_whole(es, getattr(experts, leaf).shape[0]) for leaf, es in parts.items()):
            (gu_b, gu_s), (dn_b, dn_s) = (_stacked(parts[leaf]) for leaf in ("gate_up_proj", "down_proj"))
            experts.load_mxfp4(gu_b, gu_s, dn_b, dn_s)
        elif holding:
            for leaf, es in parts.items():
                prefix = leaf.removesuffix("_proj")  # mxfp4_{gate_up,down}_{blocks,scales}
                blocks, scales = getattr(experts, f"mxfp4_{prefix}_blocks"), getattr(experts, f"mxfp4_{prefix}_scales")
                for e in es:
                    lo = e.row_offset or 0
                    blocks[lo : lo + e.data.shape[0]].copy_(e.data)
                    scales[lo : lo + e.scales.shape[0]].copy_(e.scales)
        else:
            experts.drop_mxfp4()
        held += getattr(experts, "mxfp4_gate_up_blocks", None) is not None
    return held


def _whole(entries: list[WeightEntry], rows: int) -> bool:
    """The entries (one tensor, or row slices of it) cover its ``rows`` rows exactly once."""
    spans = sorted((e.row_offset or 0, (e.row_offset or 0) + e.shape[0]) for e in entries)
    return spans[0][0] == 0 and spans[-1][1] == rows and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def _stacked(entries: list[WeightEntry]) -> tuple[Tensor, Tensor]:
    """MXFP4 blocks and scales of the whole tensor from entries ``_whole`` accepted."""
    entries = sorted(entries, key=lambda e: e.row_offset or 0)
    if len(entries) == 1:
        return entries[0].data, entries[0].scales
    return torch.cat([e.data for e in entries]), torch.cat([e.scales for e in entries])


def merge_bundles(bundles: Iterable[WeightBundle]) -> WeightBundle:
    """Several senders' bundles of one push (rank 0's first) as one bundle, so a receiver swaps
    them in with one ``apply_bundle``: between two engine steps, never half of a push.

    Each input is checked first (bucket order and version, every entry and bucket checksum,
    total bytes: what ``apply_bundle`` checks short of the receiver's names and shapes); then
    the buckets are renumbered in order and their checksums recomputed over the new index.

    Raises:
        ValueError: no bundle, versions that differ, or a failed check (naming the tensor).
    """
    bundles = list(bundles)
    if not bundles:
        raise ValueError("merge_bundles needs at least one bundle")
    version = bundles[0].version
    buckets: list[WeightBucket] = []
    for bundle in bundles:
        if bundle.version != version:
            raise ValueError(f"bundles of one push have versions {[b.version for b in bundles]}")
        _check_bundle(bundle)
        buckets += [_make_bucket(version, len(buckets) + i, list(b.entries)) for i, b in enumerate(bundle.buckets)]
    return WeightBundle(version, tuple(buckets), sum(b.total_bytes for b in bundles))


def _check_bundle(bundle: WeightBundle) -> None:
    """Bucket order and version, every checksum, total bytes (nothing about the receiver)."""
    for i, bucket in enumerate(bundle.buckets):
        if bucket.index != i or bucket.version != bundle.version:
            raise ValueError(
                f"bucket {i} of bundle version {bundle.version} is out of place: it says "
                f"index {bucket.index}, version {bucket.version} (tensors {bucket.names})"
            )
        _check_bucket(bucket)
    if (total := sum(b.nbytes for b in bundle.buckets)) != bundle.total_bytes:
        raise ValueError(
            f"bundle version {bundle.version} carries {total} payload bytes, it declares "
            f"{bundle.total_bytes}: a bucket is missing or truncated"
        )


def apply_bucket(
    model_or_state: nn.Module | Mapping[str, Tensor],
    bucket: WeightBucket,
    expected_version: int | None = None,
    dtype: torch.dtype | None = None,
    *,
    current_version: int | None = None,
) -> None:
    """Streaming counterpart of ``apply_bundle``: verify one bucket, then write it.

    Arguments as ``apply_bundle``. A receiver streaming a push passes the push's version as
    ``expected_version`` so buckets of another push are refused.
    """
    _check_version(bucket.version, expected_version, current_version)
    _check_bucket(bucket)
    _write(_plan(bucket, _targets(model_or_state)), dtype)


def _check_version(version: int, expected: int | None, current: int | None) -> None:
    if expected is not None and version != expected:
        raise ValueError(f"weight push has version {version}, the receiver expects {expected}")
    if current is not None and version <= current:
        raise ValueError(
            f"stale weight push: version {version} is not newer than the receiver's {current}"
        )


def _targets(model_or_state: nn.Module | Mapping[str, Tensor]) -> Mapping[str, Tensor]:
    if isinstance(model_or_state, nn.Module):
        return model_or_state.state_dict(keep_vars=True)  # the live Parameters, not copies
    return model_or_state


def _check_bucket(bucket: WeightBucket) -> None:
    for entry in bucket.entries:
        _verify_entry(entry)
    if _bucket_checksum(bucket.version, bucket.index, bucket.entries) != bucket.checksum:
        raise ValueError(
            f"bucket {bucket.index} (version {bucket.version}) failed its checksum; it holds "
            f"tensors {bucket.names}"
        )


def _plan(bucket: WeightBucket, targets: Mapping[str, Tensor]) -> list[tuple[Tensor, WeightEntry]]:
    """(receiver tensor, entry) per entry, after checking each name and shape against the receiver."""
    plan = []
    for entry in bucket.entries:
        target = targets.get(entry.name)
        if target is None:
            raise ValueError(f"tensor {entry.name!r} in the weight push is not in the receiver's model")
        if entry.row_offset is not None:
            lo, rows = entry.row_offset, entry.shape[0] if entry.shape else 0
            if not (entry.shape and tuple(target.shape[1:]) == entry.shape[1:] and 0 <= lo and lo + rows <= target.shape[0]):
                raise ValueError(
                    f"tensor {entry.name!r}: weight push slice rows [{lo}, {lo + rows}) of shape {entry.shape} "
                    f"does not fit receiver shape {tuple(target.shape)}"
                )
            target = target[lo : lo + rows]
        if tuple(target.shape) != entry.shape:
            raise ValueError(
                f"tensor {entry.name!r}: weight push shape {entry.shape} != receiver shape "
                f"{tuple(target.shape)}"
            )
        plan.append((target, entry))
    return plan


def _verify_entry(entry: WeightEntry) -> None:
    if entry.kind == EntryKind.MXFP4:
        lead, k = entry.shape[:-1], entry.shape[-1] if entry.shape else 0
        scales = entry.scales
        if not (
            entry.shape
            and k % 32 == 0
            and scales is not None
            and entry.data.dtype == scales.dtype == torch.uint8
            and tuple(entry.data.shape) == (*lead, k // 2)
            and tuple(scales.shape) == (*lead, k // 32)
        ):
            raise ValueError(
                f"tensor {entry.name!r}: MXFP4 payload does not match shape {entry.shape}: want "
                f"uint8 blocks {(*lead, k // 2)} and scales {(*lead, k // 32)}"
            )
        digest = _digest(scales, _digest(entry.data))
    else:
        if tuple(entry.data.shape) != entry.shape:
            raise ValueError(f"tensor {entry.name!r}: payload shape {tuple(entry.data.shape)} != {entry.shape}")
        digest = _digest(entry.data)
    if digest != entry.checksum:
        raise ValueError(f"tensor {entry.name!r}: checksum mismatch, its payload was corrupted in transit")


@torch.no_grad()
def _write(plan: Iterable[tuple[Tensor, WeightEntry]], dtype: torch.dtype | None) -> None:
    for target, entry in plan:
        if entry.kind == EntryKind.MXFP4:
            assert entry.scales is not None
            blocks, scales = entry.data.to(target.device), entry.scales.to(target.device)
            if dtype is None or dtype == target.dtype:  # decoded straight into the target (no full-size temporary on CPU)
                dequantize_mxfp4(blocks, scales, out=target)
            else:
                target.copy_(dequantize_mxfp4(blocks, scales, dtype=dtype))
        else:
            target.copy_(entry.data)


# ---------------------------------------------------------------------------------------
# checksums
# ---------------------------------------------------------------------------------------


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _digest(t: Tensor, seed: int = 0) -> int:
    """XXH3-64 of a tensor's bytes in C order (any dtype, bf16 and bool included), seeded (chaining)."""
    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return xxhash.xxh3_64_intdigest(raw.numpy(), seed=seed)


def _bucket_checksum(version: int, index: int, entries: tuple[WeightEntry, ...]) -> int:
    header = f"v{version}|i{index}\n" + "\n".join(e.describe() for e in entries)
    return xxhash.xxh3_64_intdigest(header.encode())
