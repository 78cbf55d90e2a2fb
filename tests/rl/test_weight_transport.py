"""The torch.distributed weight push (rl/weight_transport.py): 2 sending ranks -> 2 receivers over
gloo, in separate processes, against the same push applied in process; a receiver killed in the
middle of a push (slow tier)."""

import io
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from jointrl.rl.build import build_model
from jointrl.rl.config import load_config
from jointrl.rl.weight_sync import apply_bundle, build_bundle, is_routed_expert, merge_bundles
from jointrl.rl.weight_transport import decode_bucket, encode_bucket

BUCKET_BYTES = 16 << 10  # small: the tiny model's push takes many buckets


def _shares(seed: int) -> list[tuple[dict, dict]]:
    """Two senders' (state, row offsets), as with ep_size=2: rank 0 everything but the upper half
    of each layer's routed experts, rank 1 that upper half."""
    cfg = load_config([f"seed={seed}"])
    state = build_model(cfg).state_dict()
    half = cfg.model.num_experts // 2
    experts = [k for k in state if is_routed_expert(k, state[k])]
    rank0 = {k: (v[:half] if k in experts else v) for k, v in state.items()}
    rank1 = {k: state[k][half:] for k in experts}
    return [(rank0, dict.fromkeys(experts, 0)), (rank1, dict.fromkeys(experts, half))]


def _sender(rank: int, version: int, q) -> None:
    from jointrl.rl.weight_transport import WeightSender

    sender = WeightSender(num_receivers=2, timeout_s=120)
    q.put(("address", rank, sender.address))
    sender.connect()
    state, offsets = _shares(seed=7)[rank]
    times = sender.send(state, version, bucket_bytes=BUCKET_BYTES, row_offsets=offsets)
    q.put(("sent", rank, times))


def _receiver(index: int, addresses: list, version: int, q) -> None:
    from jointrl.rl.weight_transport import WeightReceiver

    receiver = WeightReceiver(addresses, index, num_receivers=2, timeout_s=120)
    bundle, _ = receiver.receive(version)
    model = build_model(load_config(["seed=1"]))
    apply_bundle(model, bundle, expected_version=version)
    buf = io.BytesIO()  # as bytes: a tensor through the queue would live in the child's shared memory
    torch.save(model.state_dict(), buf)
    q.put(("received", index, buf.getvalue(), max(b.nbytes for b in bundle.buckets if len(b.entries) > 1)))


@pytest.fixture
def _children_can_import_this_module(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))


def test_two_senders_to_two_receivers_over_gloo_land_exactly_the_in_process_push(_children_can_import_this_module):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    senders = [ctx.Process(target=_sender, args=(r, 5, q)) for r in range(2)]
    for p in senders:
        p.start()
    addresses = dict(q.get(timeout=300)[1:] for _ in range(2))
    receivers = [ctx.Process(target=_receiver, args=(i, [addresses[0], addresses[1]], 5, q)) for i in range(2)]
    for p in receivers:
        p.start()
    msgs = [q.get(timeout=300) for _ in range(4)]
    for p in senders + receivers:
        p.join(timeout=60)
        assert p.exitcode == 0

    expected = build_model(load_config(["seed=1"]))
    bundles = [build_bundle(s, 5, row_offsets=o, bucket_bytes=BUCKET_BYTES) for s, o in _shares(seed=7)]
    apply_bundle(expected, merge_bundles(bundles), expected_version=5)
    want = expected.state_dict()
    trained = build_model(load_config(["seed=7"])).state_dict()
    received = [m for m in msgs if m[0] == "received"]
    assert len(received) == 2
    for _, _, raw, biggest in received:
        state = torch.load(io.BytesIO(raw))
        assert biggest <= BUCKET_BYTES  # a bucket of several entries stays under the bound
        for k, v in want.items():
            assert torch.equal(state[k], v), k
            if is_routed_expert(k, v):  # the experts arrived as MXFP4: close to the sender's, not equal
                assert not torch.equal(state[k], trained[k]) and torch.allclose(state[k], trained[k], atol=0.1)
            else:
                assert torch.equal(state[k], trained[k]), k  # dense tensors bit for bit
    sent = [m[2] for m in msgs if m[0] == "sent"]
    assert sum(t["bytes"] for t in sent) == sum(b.total_bytes for b in bundles)


def test_wire_format_round_trips_and_corruption_is_named():
    state, offsets = _shares(seed=3)[1]
    bundle = build_bundle(state, 2, row_offsets=offsets, bucket_bytes=BUCKET_BYTES)
    wired = []
    for b in bundle.buckets:
        header, payload = encode_bucket(b)
        wired.append(decode_bucket(header, payload))
    model = build_model(load_config(["seed=1"]))
    apply_bundle(model, type(bundle)(2, tuple(wired), bundle.total_bytes), expected_version=2)

    header, payload = encode_bucket(bundle.buckets[0])
    payload[-1] ^= 0xFF  # one flipped byte in transit
    broken = decode_bucket(header, payload)
    with pytest.raises(ValueError, match=f"{broken.entries[-1].name}.*checksum mismatch"):
        merge_bundles([type(bundle)(2, (broken, *bundle.buckets[1:]), bundle.total_bytes)])
    with pytest.raises(ValueError, match="version 2, the receiver expects 3"):
        apply_bundle(model, bundle, expected_version=3)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _restarted_pid(worker) -> int:
    """The worker's pid once Ray has restarted it (calls fail while it restarts)."""
    import ray

    for _ in range(600):
        try:
            return ray.get(worker.pid.remote())
        except ray.exceptions.RayActorError:
            time.sleep(0.5)
    raise AssertionError("the killed rollout worker was not restarted")


@pytest.mark.slow
def test_a_receiver_killed_mid_push_is_left_out_and_gets_the_next_one(cluster):
    """SIGKILL of a rollout worker in the middle of a dist broadcast: the push completes to the live
    worker (closed groups fail every member at once; the driver rebuilds them and pushes again),
    well inside a gloo timeout of an hour, and the restarted worker gets the next push."""
    import ray

    from jointrl.rl.learner.group import LearnerGroup
    from jointrl.rl.rollout.worker import RolloutWorker
    from jointrl.rl.weight_transport import WeightPush

    # bench_moe at 12 layers: a push is ~0.7 sender CPU-seconds of quantizing, streamed between ~80 broadcasts
    cfg = load_config(["model=bench_moe", "model.num_hidden_layers=12", "rollout.num_blocks=64",
                       "rollout.weight_transport=dist", "rollout.weight_bucket_mb=0.25"])
    learner = LearnerGroup(cfg)
    workers = [ray.remote(max_concurrency=1000, max_restarts=-1)(RolloutWorker).remote(cfg) for _ in range(2)]
    push = WeightPush("dist", learner.senders, workers, "gloo", timeout_s=3600)
    sender_pid, victim = ray.get(learner.workers[0].pid.remote()), ray.get(workers[0].pid.remote())
    push(1)  # connects the groups
    assert push.live == [0, 1] and push.retries == 0
    start = _cpu_seconds(sender_pid)
    push(2)  # a push's cost in sender CPU seconds, which times the kill in push 3
    assert push.retries == 0
    cost = _cpu_seconds(sender_pid) - start

    start = _cpu_seconds(sender_pid)
    pushing = threading.Thread(target=push, args=(3,))
    pushing.start()
    # a fifth of the way into the sender's work (a fixed CPU mark could fall after the push on a fast machine)
    while pushing.is_alive() and _cpu_seconds(sender_pid) - start < 0.2 * cost:
        time.sleep(0.002)
    assert pushing.is_alive(), f"push 3 ended before the kill (a push costs the sender {cost:.2f} CPU-s)"
    os.kill(victim, signal.SIGKILL)
    pushing.join(timeout=900)
    assert not pushing.is_alive(), "the push stalled on the dead receiver"
    assert push.retries >= 1 and 1 in push.live
    assert ray.get(workers[1].version.remote()) == 3

    assert _restarted_pid(workers[0]) != victim  # Ray restarts the killed worker (max_restarts=-1)
    push(4)  # it is in the rebuilt groups and holds the weights
    assert push.live == [0, 1]
    assert ray.get([w.version.remote() for w in workers]) == [4, 4]
    states = ray.get([w.__ray_call__.remote(lambda self: self.engine.model.state_dict()) for w in workers])
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    learner.shutdown()
