"""``RolloutWorker``: a Ray actor that owns one rollout engine and its weights."""

from __future__ import annotations

import asyncio
import os
import time

import torch

from jointrl.rl.actor_resources import ActorResources, claim
from jointrl.rl.build import build_model, build_tokenizer
from jointrl.kernels.dispatch import resolve
from jointrl.rl.config import Config
from jointrl.rl.device import HOST, as_device
from jointrl.rl.rollout.llm_engine import EngineConfig, LLMEngine
from jointrl.rl.rollout.sampler import SimpleSampler
from jointrl.rl.rollout.vllm.engine import VLLMEngine, VLLMEngineConfig
from jointrl.rl.types import GenerationOutput, SamplingParams
from jointrl.rl.weight_sync import merge_bundles
from jointrl.rl.weight_transport import WeightReceiver


def engine_device(kernels: str, batch_invariant: bool = False, device: torch.device | str | None = None
                  ) -> tuple[torch.device, str]:
    """Where the own engine (and the simple sampler) runs, and why: ``device`` (None: this process's
    ``rl/device.rank_device()``) when it is a GPU and ``model.kernels`` runs there (``auto`` or
    ``triton``: Triton kernels; ``torch``: the references), else the host -- ``cpu`` is the C++ CPU
    kernels, and ``rollout.batch_invariant`` needs them. → (device, a one-line reason for the log)."""
    device = as_device(device)
    if device.type == "cpu":
        return HOST, f"no GPU visible: model.kernels={kernels} runs as {resolve(kernels, HOST)!r} on the host"
    if batch_invariant:
        return HOST, f"rollout.batch_invariant needs the C++ CPU kernels: on the host, though {device} is visible"
    if kernels == "cpu":
        return HOST, f"model.kernels=cpu runs on the host only, though {device} is visible"
    return device, f"model.kernels={kernels} runs as {resolve(kernels, device)!r} on {device}"


class RolloutWorker:
    """Async actor: concurrent ``generate`` calls from env workers are batched by the engine."""

    def __init__(self, cfg: Config, index: int = 0) -> None:
        self._resources = claim("rollout", index)  # torch threads = the bundle's CPUs, before the engine starts
        self._slept = False  # colocated: the first sleep prints what it does on this build
        self.offload_weights = cfg.rollout.colocate_offload_weights  # the own engine's, while asleep
        self.cfg_backend = "vLLM" if cfg.rollout.backend == "vllm" else "engine"
        torch.manual_seed(cfg.seed)
        r = cfg.rollout
        if r.backend in ("engine", "simple"):  # on the GPU where the kernel backend runs there (engine_device)
            device, why = engine_device(str(cfg.model.kernels), r.batch_invariant)
            print(f"rollout worker {index}: {r.backend} engine on {device} ({why})", flush=True)
            self.device = device
        if r.backend == "engine":
            self.engine = LLMEngine(build_model(cfg, device), build_tokenizer(cfg), EngineConfig(
                num_blocks=r.num_blocks, block_size=r.block_size, max_num_seqs=r.max_batch,
                max_num_batched_tokens=r.max_num_batched_tokens, session_ttl_s=r.session_ttl_s, kv_dtype=r.kv_dtype,
                live_sessions=r.live_sessions, batch_invariant=r.batch_invariant, decode_graphs=r.decode_graphs,
                return_routed_experts=getattr(cfg.learner, "routing_replay", False)))
        elif r.backend == "vllm":  # pushes are applied to a copy of model.path's weights (build_model)
            v = r.vllm
            self.engine = VLLMEngine(VLLMEngineConfig(
                cfg.model.path, build_tokenizer(cfg).im_end_id, str(cfg.model.dtype), v.venv, r.max_context,
                r.max_batch, max(r.max_num_batched_tokens, r.max_context), v.kv_cache_mb, v.tensor_parallel_size,
                v.data_parallel_size, v.enable_expert_parallel, cfg.seed, v.start_timeout_s,
                sleep_level=v.sleep_level if cfg.cluster.colocate else 0),  # colocated: sleeps per learner step
                build_model(cfg, HOST).state_dict())  # host copy: the push rewrites it, vLLM holds the GPU one
        else:
            self.engine = SimpleSampler(build_model(cfg, device), build_tokenizer(cfg), max_batch=r.max_batch,
                                        record_routes=cfg.learner.routing_replay)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, image_patches=None) -> GenerationOutput:
        if image_patches is None:
            return await self.engine.generate(prompt_ids, params)
        return await self.engine.generate(prompt_ids, params, image_patches=image_patches)

    def update_weights(self, version: int, *bundles) -> dict[str, float]:
        """One push through Ray's object store: every sending rank's bundle (rank 0's first),
        swapped in together (``merge_bundles``). Seconds spent, by phase."""
        t0 = time.perf_counter()
        bundle = merge_bundles([b for b in bundles if b is not None])
        t1 = time.perf_counter()
        self.engine.update_weights(version, bundle)
        return {"merge": t1 - t0, "apply": time.perf_counter() - t1}

    # rollout.weight_transport=dist (rl/weight_transport.py)
    def join_weight_group(self, addresses: list, index: int, num_receivers: int, backend: str, timeout_s: float) -> None:
        if getattr(self, "receiver", None) is not None:  # rebuilt groups: leave the old ones first
            self.receiver.close()
        self.receiver = WeightReceiver([tuple(a) for a in addresses], index, num_receivers, backend, timeout_s)

    async def receive_weights(self, version: int) -> dict[str, float]:
        """The transfer runs off the event loop (requests in flight keep being served); the swap is
        one ``update_weights``, between two engine steps."""
        bundle, times = await asyncio.to_thread(self.receiver.receive, version)
        t0 = time.perf_counter()
        self.engine.update_weights(version, bundle)
        return {**times, "apply": time.perf_counter() - t0}

    # colocated mode (cluster.colocate=true, the driver rl/train.py): the device to the learner and back
    async def sleep(self) -> int:
        """The engine asleep through the learner step and push: the own engine waits for its requests in
        flight, holds new ones, frees its KV pool (and with ``rollout.colocate_offload_weights`` moves its
        weights to the host: rl/rollout/sleep.py); vLLM sleeps at ``rollout.vllm.sleep_level``.
        → the bytes of the KV pool still held (the own engine; 0: freed) or -1 (vLLM: not measured)."""
        if isinstance(self.engine, LLMEngine):
            await self.engine.sleep_when_idle(self.offload_weights)
            held = self.engine.kv_cache_bytes
            what = (f"KV pool of {self.engine.sleep_state.pool_bytes} bytes freed, {held} still held; weights on "
                    f"{next(self.engine.model.parameters()).device}")
        else:  # off the event loop: requests arriving meanwhile reach the engine process, which holds them
            await asyncio.to_thread(self.engine.sleep)
            held, what = -1, (f"sleep level {self.engine.config.sleep_level}, frees GPU memory: "
                              f"{self.engine.sleep_frees_memory}")
        if not self._slept:  # once: what the sleep does on this build
            self._slept = True
            print(f"rollout worker {self._resources.index}: {self.cfg_backend} asleep during the learner step "
                  f"({what})", flush=True)
        return held

    async def wake_up(self) -> None:
        """The engine awake again (a no-op for an own engine that is: one Ray restarted during the step)."""
        if isinstance(self.engine, LLMEngine):
            if self.engine.asleep:
                await self.engine.wake_up_and_serve()
        else:
            await asyncio.to_thread(self.engine.wake_up)

    def kv_cache_bytes(self) -> int:
        """The own engine's KV / index / latent pool bytes (asleep: those still held)."""
        return self.engine.kv_cache_bytes

    async def close(self) -> None:
        await self.engine.close()

    def version(self) -> int:
        return self.engine.version

    def pid(self) -> int:
        return os.getpid()

    def resources(self) -> ActorResources:
        return self._resources
