"""Weight push over torch.distributed (gloo, CPU): MXFP4 push vs bf16 push vs memcpy of the same bytes.

Run: ``python tests/bench/bench_weight_sync.py [--model bench_moe] [--receivers 2] [--repeats 5]``.

One sender process (a learner rank holding the whole model) pushes to ``--receivers`` rollout
processes through ``rl/weight_transport.py``, exactly as ``rollout.weight_transport=dist`` does:

* **MXFP4 push**: routed experts MXFP4, everything else bf16 (what the rollout runs).
* **bf16 push**: every tensor bf16, nothing quantized.

Per case, the median over ``--repeats`` pushes of each phase: quantize (MXFP4 + dense copies + CRCs,
bucket by bucket), transfer (encode + gloo broadcast, the sender's clock), apply (verify + dequantize + copy into the receiver's model, the slowest
receiver), and the whole push. "memcpy" rows copy the same number of payload bytes with one
``Tensor.copy_`` in one process. GB/s = payload bytes / seconds. Reports; never asserts.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

CASES = {"MXFP4 push": True, "bf16 push": False}  # name -> routed experts quantized


def _state(model: str) -> dict[str, torch.Tensor]:
    from jointrl.rl.build import build_model
    from jointrl.rl.config import load_config

    return build_model(load_config([f"model={model}"])).state_dict()


def _quantize_fn(quantize: bool):
    from jointrl.rl.weight_sync import is_routed_expert

    return is_routed_expert if quantize else (lambda name, t: False)


def _sender(args, q) -> None:
    torch.set_num_threads(1)
    from jointrl.rl.weight_transport import WeightSender

    sender = WeightSender(num_receivers=args.receivers, timeout_s=600)
    q.put(("address", sender.address))
    sender.connect()
    state = _state(args.model)
    version = 0
    for name, quantize in CASES.items():
        for _ in range(args.repeats + 1):  # the first push of each case warms up
            version += 1
            sender.group.broadcast(torch.zeros(1))  # every receiver is done applying the last push
            t = sender.send(state, version, bucket_bytes=args.bucket_mb << 20, is_quantized=_quantize_fn(quantize),
                            dense_dtype=torch.bfloat16)
            q.put(("sent", name, t))


def _receiver(args, index: int, address, q) -> None:
    torch.set_num_threads(1)
    from jointrl.rl.build import build_model
    from jointrl.rl.config import load_config
    from jointrl.rl.weight_sync import apply_bundle
    from jointrl.rl.weight_transport import WeightReceiver

    receiver = WeightReceiver([address], index, num_receivers=args.receivers, timeout_s=600)
    model = build_model(load_config([f"model={args.model}", "seed=1"]))
    version = 0
    for name in CASES:
        for _ in range(args.repeats + 1):
            version += 1
            receiver.groups[0].broadcast(torch.zeros(1))
            bundle, t = receiver.receive(version)
            t0 = time.perf_counter()
            apply_bundle(model, bundle, expected_version=version)
            q.put(("applied", name, {**t, "apply": time.perf_counter() - t0}))


def _memcpy_s(nbytes: int, repeats: int) -> float:
    src, dst = torch.randint(0, 255, (nbytes,), dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench_moe", help="a conf/model/ name")
    parser.add_argument("--receivers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-mb", type=int, default=32)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[2].parent))  # spawned children import jointrl alike

    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_sender, args=(args, q))]
    procs[0].start()
    kind, address = q.get(timeout=600)
    procs += [ctx.Process(target=_receiver, args=(args, i, address, q)) for i in range(args.receivers)]
    for p in procs[1:]:
        p.start()
    pushes = len(CASES) * (args.repeats + 1)
    sent: dict[str, list[dict]] = {n: [] for n in CASES}
    applied: dict[str, list[dict]] = {n: [] for n in CASES}
    for _ in range(pushes * (1 + args.receivers)):
        kind, name, t = q.get(timeout=600)
        (sent if kind == "sent" else applied)[name].append(t)
    for p in procs:
        p.join(timeout=60)

    params = sum(v.numel() for v in _state(args.model).values())
    print(f"weight push over gloo, 1 sender -> {args.receivers} receivers (processes, 1 torch thread each), "
          f"model {args.model} ({params / 1e6:.1f} M params, {params * 4 / 2**20:.1f} MiB fp32), "
          f"buckets <= {args.bucket_mb} MiB, median of {args.repeats} (after 1 warm-up)")
    print(f"{'case':<22}{'MiB':>8}{'quant ms':>10}{'xfer ms':>10}{'apply ms':>10}"
          f"{'total ms':>10}{'GB/s':>8}{'x memcpy':>10}")
    for name in CASES:
        s = sent[name][1:]
        a = [t for i, t in enumerate(applied[name]) if i >= args.receivers]  # drop each receiver's warm-up
        nbytes = int(s[0]["bytes"])
        med = {k: statistics.median(t[k] for t in s) for k in ("quantize", "transfer")}
        # the slowest receiver of each push bounds it
        per_push = [max(a[i : i + args.receivers], key=lambda t: t["apply"])["apply"]
                    for i in range(0, len(a), args.receivers)]
        med["apply"] = statistics.median(per_push)
        total = sum(med.values())
        copy_s = _memcpy_s(nbytes, args.repeats)
        print(f"{name:<22}{nbytes / 2**20:>8.2f}{med['quantize'] * 1e3:>10.1f}"
              f"{med['transfer'] * 1e3:>10.1f}{med['apply'] * 1e3:>10.1f}{total * 1e3:>10.1f}"
              f"{nbytes / total / 1e9:>8.3f}{total / copy_s:>10.0f}")
        print(f"{'  memcpy same bytes':<22}{nbytes / 2**20:>8.2f}{'':>30}{copy_s * 1e3:>10.2f}{nbytes / copy_s / 1e9:>8.2f}{1:>10}")


if __name__ == "__main__":
    main()
