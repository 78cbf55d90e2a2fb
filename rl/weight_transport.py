"""How a weight push travels from the learner ranks to the rollout workers: ``rollout.weight_transport``.

``ray`` (default): each sending learner rank builds its ``WeightBundle`` (``weight_sync.py``) and
the driver hands the ObjectRefs to every rollout worker; Ray's object store carries them.

``dist``: a ``torch.distributed`` broadcast, gloo on the host, NCCL on GPUs (the same code: a
group's buffers live on its device, ``_Group.device``). Each sending rank (learner ranks ``0..ep_size-1``: rank 0 the shared parameters and
its experts, the others their experts) owns one process group ``{sender, receiver_0, ...}``
built on its own ``TCPStore``, apart from the default group DeepSpeed uses: no learner rank
waits on another's push, and rollout workers need no place in the learners' world. The sender
quantizes where its weights are and streams one bucket at a time, built on the group's device
(``iter_buckets``, ``rollout.weight_bucket_mb``):
per bucket one broadcast of two lengths, one of the bytes (``encode_bucket``), then an end
marker with the bucket count and total bytes. A receiver collects every sender's buckets,
rebuilds the bundles, and swaps them in with one ``update_weights`` of ``merge_bundles``:
version, names, shapes and every CRC are checked before anything is written, and an engine
step never sees half a push.

Timings (seconds) come back per push: ``quantize`` (MXFP4 + dense copies + checksums), ``transfer`` (encode + broadcast, sender side),
``receive`` and ``apply`` (verify + dequantize + copy, receiver side).
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import Tensor

from jointrl.kernels.mxfp4 import ScaleRule
from jointrl.rl.device import HOST
from jointrl.rl.weight_sync import EntryKind, WeightBucket, WeightBundle, WeightEntry, iter_buckets, merge_bundles

_ALIGN = 16  # payload pieces start at multiples of this, so they can be viewed as any dtype in place


# ---------------------------------------------------------------------------------------
# wire format: one bucket as (header JSON, payload bytes)
# ---------------------------------------------------------------------------------------


def encode_bucket(bucket: WeightBucket, device: torch.device | None = None) -> tuple[bytes, Tensor]:
    """(header, payload): the header is JSON of every field but the tensors, the payload every
    entry's data then scales, each piece at an offset aligned to 16 bytes, on ``device`` (None: the
    first entry's)."""
    entries, pieces, offset = [], [], 0
    for e in bucket.entries:
        meta = {"name": e.name, "kind": str(e.kind), "shape": list(e.shape), "dtype": _dtype_name(e.dtype),
                "scale_rule": None if e.scale_rule is None else str(e.scale_rule), "checksum": e.checksum,
                "row_offset": e.row_offset}
        for key, t in (("data", e.data), ("scales", e.scales)):
            if t is None:
                meta[key] = None
                continue
            offset = -(-offset // _ALIGN) * _ALIGN
            raw = t.contiguous().reshape(-1).view(torch.uint8)
            meta[key] = {"offset": offset, "shape": list(t.shape), "dtype": _dtype_name(t.dtype)}
            pieces.append((offset, raw))
            offset += raw.numel()
        entries.append(meta)
    if device is None:
        device = bucket.entries[0].data.device if bucket.entries else HOST
    payload = torch.empty(offset, dtype=torch.uint8, device=device)
    for start, raw in pieces:
        payload[start : start + raw.numel()] = raw
    header = json.dumps({"version": bucket.version, "index": bucket.index, "checksum": bucket.checksum,
                         "entries": entries}).encode()
    return header, payload


def decode_bucket(header: bytes, payload: Tensor) -> WeightBucket:
    """Inverse of ``encode_bucket``; the entries' tensors are views into ``payload``. Nothing is
    verified here: ``apply_bundle`` / ``merge_bundles`` check every checksum."""
    h = json.loads(header)

    def piece(meta: dict | None) -> Tensor | None:
        if meta is None:
            return None
        dtype = _dtype(meta["dtype"])
        n = _numel(meta["shape"]) * torch.empty((), dtype=dtype).element_size()
        return payload[meta["offset"] : meta["offset"] + n].view(dtype).reshape(meta["shape"])

    entries = tuple(
        WeightEntry(name=m["name"], kind=EntryKind(m["kind"]), shape=tuple(m["shape"]), dtype=_dtype(m["dtype"]),
                    scale_rule=None if m["scale_rule"] is None else ScaleRule(m["scale_rule"]),
                    data=piece(m["data"]), scales=piece(m["scales"]), checksum=m["checksum"],
                    row_offset=m["row_offset"])
        for m in h["entries"]
    )
    return WeightBucket(h["version"], h["index"], entries, h["checksum"])


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"weight push names an unknown dtype {name!r}")
    return dtype


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# ---------------------------------------------------------------------------------------
# one sender's process group
# ---------------------------------------------------------------------------------------


class _Group:
    """A process group of its own (store + gloo/NCCL), rank 0 the sender; usable beside the
    default group of the process."""

    def __init__(self, store: dist.Store, rank: int, size: int, backend: str, timeout_s: float) -> None:
        timeout = datetime.timedelta(seconds=timeout_s)
        if backend == "nccl":
            self.pg, self.device = dist.ProcessGroupNCCL(store, rank, size), torch.device("cuda")
        else:
            self.pg, self.device = dist.ProcessGroupGloo(store, rank, size, timeout), HOST

    def broadcast(self, t: Tensor) -> Tensor:
        """``t`` from rank 0 to everyone, in place; returns it (on this group's device)."""
        t = t.to(self.device)
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([t], opts).wait()
        return t

    def close(self) -> None:
        """Drop this member's connections: every other member blocked in a broadcast of this group
        fails now ("connection closed by peer") instead of at the group's timeout. (``pg.abort()``
        and ``pg.shutdown()`` do not do this in torch 2.13's gloo: a peer blocked on us still
        waits; destroying the group closes the sockets.)"""
        self.pg = None


class WeightSender:
    """One learner rank's end: ``open`` (a store on a free port) -> ``connect`` (collective with
    the receivers) -> ``send`` per push."""

    def __init__(self, num_receivers: int, backend: str = "gloo", timeout_s: float = 600.0) -> None:
        import ray

        self.host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        self.size, self.backend, self.timeout_s = num_receivers + 1, backend, timeout_s
        self.store = dist.TCPStore(self.host, 0, self.size, True, datetime.timedelta(seconds=timeout_s),
                                   wait_for_workers=False)
        self.group: _Group | None = None

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.store.port

    def connect(self) -> None:
        self.group = _Group(self.store, 0, self.size, self.backend, self.timeout_s)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None

    def send(self, state: Mapping[str, Tensor], version: int, bucket_bytes: int, **bucket_kw) -> dict[str, float]:
        """Quantize ``state`` where it is and broadcast it bucket by bucket from the group's device. A failed
        broadcast (a receiver died) closes the group, so the live receivers fail at once too."""
        assert self.group is not None, "WeightSender.connect() first"
        try:
            return self._send_all(state, version, bucket_bytes, **bucket_kw)
        except Exception:
            self.close()
            raise

    def _send_all(self, state: Mapping[str, Tensor], version: int, bucket_bytes: int, **bucket_kw) -> dict[str, float]:
        times = {"quantize": 0.0, "transfer": 0.0}
        buckets = iter_buckets(state, version, bucket_bytes=bucket_bytes, device=self.group.device, **bucket_kw)
        count = total = 0
        while True:
            t0 = time.perf_counter()
            bucket = next(buckets, None)
            t1 = time.perf_counter()
            times["quantize"] += t1 - t0
            if bucket is None:
                break
            header, payload = encode_bucket(bucket, self.group.device)
            self._send(header, payload)
            count, total = count + 1, total + bucket.nbytes
            times["transfer"] += time.perf_counter() - t1
        t0 = time.perf_counter()
        self._send(json.dumps({"end": True, "version": version, "buckets": count, "total_bytes": total}).encode(), None)
        times["transfer"] += time.perf_counter() - t0
        times["bytes"] = float(total)
        return times

    def _send(self, header: bytes, payload: Tensor | None) -> None:
        n = 0 if payload is None else payload.numel()
        self.group.broadcast(torch.tensor([len(header), n], dtype=torch.int64))
        self.group.broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        if n:
            self.group.broadcast(payload)


class WeightReceiver:
    """A rollout worker's end: joins every sender's group (collective with ``WeightSender.connect``)."""

    def __init__(self, addresses: list[tuple[str, int]], index: int, num_receivers: int, backend: str = "gloo",
                 timeout_s: float = 600.0) -> None:
        size, timeout = num_receivers + 1, datetime.timedelta(seconds=timeout_s)
        self.groups = [_Group(dist.TCPStore(host, port, size, False, timeout), index + 1, size, backend, timeout_s)
                       for host, port in addresses]

    def receive(self, version: int) -> tuple[WeightBundle, dict[str, float]]:
        """Every sender's buckets of push ``version``, checked and merged into one bundle. A failed
        broadcast closes every group of this receiver (their senders fail at once too)."""
        t0 = time.perf_counter()
        try:
            bundles = [self._receive_one(g, version) for g in self.groups]
        except Exception:
            self.close()
            raise
        t1 = time.perf_counter()
        merged = merge_bundles(bundles)
        return merged, {"receive": t1 - t0, "merge": time.perf_counter() - t1}

    def close(self) -> None:
        for g in self.groups:
            g.close()

    @staticmethod
    def _receive_one(group: _Group, version: int) -> WeightBundle:
        buckets = []
        while True:
            lengths = group.broadcast(torch.zeros(2, dtype=torch.int64)).cpu()
            header = bytes(group.broadcast(torch.empty(int(lengths[0]), dtype=torch.uint8)).cpu().numpy())
            if not lengths[1]:
                end = json.loads(header)
                if end["version"] != version:
                    raise ValueError(f"weight push has version {end['version']}, the receiver expects {version}")
                if end["buckets"] != len(buckets):
                    raise ValueError(f"weight push version {version}: the sender sent {end['buckets']} buckets, "
                                     f"{len(buckets)} arrived")
                return WeightBundle(version, tuple(buckets), int(end["total_bytes"]))
            payload = group.broadcast(torch.empty(int(lengths[1]), dtype=torch.uint8))  # stays on the group's device
            buckets.append(decode_bucket(header, payload))


# ---------------------------------------------------------------------------------------
# the driver's side
# ---------------------------------------------------------------------------------------


class WeightPush:
    """Called once per push by the driver: ``push(version)`` -> seconds per phase (max over ranks).

    ``senders`` are learner-rank actors with ``weight_bundle`` (ray) or ``open_weight_group`` /
    ``join_weight_group`` / ``push_weights`` (dist); ``receivers`` rollout-worker actors with
    ``update_weights`` / ``pid`` / ``join_weight_group`` / ``receive_weights``. After a push, ``live`` lists the receivers that hold it: a dead
    receiver is left out (ray: its call fails; dist: it does not answer ``pid``), and a restarted
    one (a new pid) gets the push -- with ``dist``, the groups are rebuilt over the receivers that
    answer whenever that set changes.

    ``dist`` and a receiver that dies during the broadcast: the sender's next write to it fails
    at once (connection reset) and the sender closes its group, which fails the live receivers'
    reads at once; they close all their groups, which fails any other sender still writing. The
    driver then rebuilds the groups over the receivers that answer and pushes the same version
    again (``retries`` counts it), at most ``MAX_ATTEMPTS`` times. A receiver Ray is restarting
    answers once it is back, so it gets this push or the next one.
    """

    MAX_ATTEMPTS = 3

    def __init__(self, transport: str, senders: list, receivers: list, backend: str = "gloo",
                 timeout_s: float = 600.0) -> None:
        self.transport, self.senders, self.receivers = transport, senders, receivers
        self.backend, self.timeout_s = backend, timeout_s
        self.members: list[tuple[int, int]] = []  # dist: (receiver index, pid) in the current groups
        self.live: list[int] = []
        self.retries = 0  # dist: re-pushes the last push needed (a member failed mid-broadcast)

    def _connect(self) -> list[int]:
        """dist: the receivers that answer now; (re)build the groups when they differ from the last ones."""
        import ray

        members = []
        for i, r in enumerate(self.receivers):
            try:
                members.append((i, ray.get(r.pid.remote(), timeout=self.timeout_s)))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass
        if not members:
            raise RuntimeError("weight push: no rollout worker is alive")
        if members != self.members:
            n = len(members)
            addresses = ray.get([s.open_weight_group.remote(n, self.backend, self.timeout_s) for s in self.senders])
            ray.get([s.join_weight_group.remote() for s in self.senders]
                    + [self.receivers[i].join_weight_group.remote(addresses, k, n, self.backend, self.timeout_s)
                       for k, (i, _) in enumerate(members)])
            self.members = members
        return [i for i, _ in members]

    def _push_dist(self, version: int) -> tuple[list[dict], int]:
        """One dist push, retried over rebuilt groups when a member fails → (per-rank times, retries)."""
        import ray

        errors: list[str] = []
        for attempt in range(self.MAX_ATTEMPTS):
            live = self._connect()
            refs = [s.push_weights.remote(version) for s in self.senders]
            refs += [self.receivers[i].receive_weights.remote(version) for i in live]
            results, failed = [], None
            for ref in refs:  # a failure anywhere fails everyone's broadcast at once (closed groups)
                try:
                    results.append(ray.get(ref))
                except Exception as e:  # noqa: BLE001 -- a dead receiver or a broken group: rebuild, retry
                    failed = failed or e
            if failed is None:
                self.live = live
                return results, attempt
            errors.append(repr(failed)[:300])
            self.members = []  # rebuild the groups over whoever answers now
        raise RuntimeError(f"weight push {version}: failed {self.MAX_ATTEMPTS} times over rebuilt groups: {errors}")

    def __call__(self, version: int) -> dict[str, float]:
        import ray

        t0 = time.perf_counter()
        self.retries = 0
        if self.transport == "dist":
            sent, self.retries = self._push_dist(version)
        else:
            bundles = [s.weight_bundle.remote(version) for s in self.senders]
            refs = [r.update_weights.remote(version, *bundles) for r in self.receivers]
            sent, self.live = [], []
            for i, ref in enumerate(refs):
                try:
                    sent.append(ray.get(ref))
                    self.live.append(i)
                except ray.exceptions.RayActorError:
                    pass
            if not self.live:
                raise RuntimeError(f"weight push {version}: no rollout worker is alive")
        times = {k: max(t.get(k, 0.0) for t in sent) for k in {k for t in sent for k in t} if k != "bytes"}
        times["total"] = time.perf_counter() - t0
        return times
