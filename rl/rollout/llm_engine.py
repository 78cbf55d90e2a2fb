"""``LLMEngine``: the fast rollout engine (a ``RolloutEngine``): continuous batching over a
paged KV cache, sessions, shared prefill for GRPO groups, prefix caching, preemption.

    step():  requests queued since the last step join  →  Scheduler.schedule
             →  ModelRunner.run (one forward of every scheduled token)  →  sample_rows
             →  record tokens, end turns (sessions go idle)

``generate`` (async, the ``RolloutEngine`` method) queues a request and awaits its turn;
one background task runs ``step`` in a worker thread for as long as there is work, so
requests join and leave the running batch between decode steps. ``generate_batch`` is the
same loop, synchronous.

Weights. ``update_weights(version, bundle)`` waits for the current step, loads the bundle
(MXFP4 experts dequantized into the model's cached dense copy on CPU) and applies the
live-session policy: ``keep`` (default) leaves cached keys/values of live and idle
sessions as they are, and each turn records the version that sampled it in
``GenerationOutput.policy_version`` (the version of the turn's first sampled token: one
version per turn, exact when updates land between turns, as in the synchronous trainer; a
turn spanning an update is not split per token); ``reprefill`` drops every cache so all
sequences recompute under the new weights. Prefix-cache keys include the version, so new requests never share blocks
computed by older weights.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from jointrl.model import MoETransformer
from jointrl.model.tokenizer import ByteTokenizer
from jointrl.rl.device import HOST
from jointrl.rl.rollout.block_manager import BlockManager
from jointrl.rl.rollout.model_runner import ModelRunner
from jointrl.rl.rollout.sampling import sample_rows
from jointrl.rl.rollout.scheduler import Scheduler
from jointrl.rl.rollout.sequence import Sequence
from jointrl.rl.rollout.sleep import SleepState, check_awake, pool_bytes_held, sleep, wake_up
from jointrl.rl.types import ROUTE_DTYPE, GenerationOutput, SamplingParams
from jointrl.rl.weight_sync import apply_bundle, hold_mxfp4_experts

LIVE_SESSION_POLICIES = ("keep", "reprefill")
KV_DTYPES = {"auto": None, "bfloat16": torch.bfloat16}  # rollout.kv_dtype -> the cache dtype (None: the model's)
PRESSURE_WARN_S = 60.0  # at most one KV-pressure warning a minute (the first at once)


@dataclass(slots=True)
class EngineConfig:
    """KV memory is ``num_blocks`` × ``block_size`` token slots (``LLMEngine.kv_cache_bytes``)."""
    num_blocks: int = 512
    block_size: int = 16
    max_num_seqs: int = 256                # sequences in the running batch
    max_num_batched_tokens: int = 512      # tokens per forward: decodes + prefill chunks
    session_ttl_s: float = 60.0            # idle sessions older than this are evicted (0: no sessions)
    live_sessions: str = "keep"            # on update_weights: keep caches, or reprefill
    return_routed_experts: bool = False    # GenerationOutput.routed_experts / routed_from (routing replay)
    ignore_eos: bool = False               # benchmarks: <|im_end|> does not end a turn
    kv_dtype: str = "auto"                 # KV cache: auto (the model's dtype) | bfloat16 (float32 models, opt-in)
    batch_invariant: bool = False          # a request's tokens independent of what shares its steps (ModelRunner)
    decode_graphs: bool = False            # pure decode steps in CUDA graphs per bucket (rl/rollout/cuda_graphs.py)

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be a positive int, got {value!r}")
        if self.session_ttl_s < 0:
            raise ValueError(f"EngineConfig.session_ttl_s must be >= 0, got {self.session_ttl_s!r}")
        if self.live_sessions not in LIVE_SESSION_POLICIES:
            raise ValueError(f"EngineConfig.live_sessions must be one of {list(LIVE_SESSION_POLICIES)}, "
                             f"got {self.live_sessions!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"EngineConfig.kv_dtype must be one of {list(KV_DTYPES)}, got {self.kv_dtype!r}")


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    computed_tokens: int = 0   # positions run through the model (prefill chunks + decodes)
    prompt_tokens: int = 0     # prompt tokens of all requests (before cache reuse)
    forward_s: float = 0.0     # time in ModelRunner.run
    step_s: float = 0.0        # time in step(), forward included


class LLMEngine:
    def __init__(self, model: MoETransformer, tokenizer: ByteTokenizer | None = None,
                 config: EngineConfig | None = None, device: torch.device | str | None = None) -> None:
        """``device``: where the weights, KV pool and states live (None: where ``model`` is; else the
        model is moved there)."""
        self.config = config or EngineConfig()
        self.model = model.eval()
        if device is not None:  # moved: its kernel table is chosen again for the new device
            self.model.to(device).set_kernels(model.kernels_choice)
        self.tok = tokenizer or ByteTokenizer()
        self._version = 0
        self._sleep: SleepState | None = None  # set while asleep (rl/rollout/sleep.py)
        self._build_caches()
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._inbox: deque[Sequence] = deque()  # appended by the event loop, drained by step()
        self._lock = threading.Lock()           # one step or one weight update at a time
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._serving: asyncio.Event | None = None  # cleared from sleep_when_idle to wake_up_and_serve
        self._warned: tuple[int, float] = (0, -PRESSURE_WARN_S)  # drops counted at the last warning, and when

    def _build_caches(self) -> None:
        """The block manager, the runner with its KV pool on the model's device, and the scheduler:
        everything ``sleep`` releases and ``wake_up`` builds again."""
        cfg = self.config
        self.block_manager = BlockManager(cfg.num_blocks, cfg.block_size)
        self.runner = ModelRunner(self.model, cfg.num_blocks, cfg.block_size, cfg.batch_invariant,
                                  kv_dtype=KV_DTYPES[cfg.kv_dtype], decode_graphs=cfg.decode_graphs)
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   cfg.session_ttl_s, prefix_cache=self.runner.prefix_cacheable)
        self.scheduler.version = self._version

    # -- colocated mode: rl/rollout/sleep.py ------------------------------------------------
    def sleep(self, offload_weights: bool = False, offload_to: torch.device | str = HOST) -> None:
        """Release the KV pool and every cache (and, with ``offload_weights``, move the weights to
        ``offload_to``, the host) while the learner uses the device; ``wake_up`` takes them back. A
        failed sleep leaves the engine awake and whole. ``rollout/sleep.py``."""
        sleep(self, offload_weights, offload_to)

    def wake_up(self) -> None:
        wake_up(self)

    async def sleep_when_idle(self, offload_weights: bool = False, offload_to: torch.device | str = HOST) -> None:
        """``sleep`` for an engine serving ``generate`` (the Ray rollout worker's, colocated): requests
        arriving from now on are held until ``wake_up_and_serve``, the ones in flight finish first. If the
        sleep fails (or this is cancelled) the engine serves again, awake, and the error propagates."""
        check_awake(self)
        self._start_serving()
        self._serving.clear()
        try:
            while self._inbox or self.scheduler.has_work():  # the serve loop finishes them (ms per step)
                await asyncio.sleep(0.005)
            self.sleep(offload_weights, offload_to)
        except BaseException:
            self._serving.set()  # awake and whole (sleep changed nothing): the held requests run
            raise

    async def wake_up_and_serve(self) -> None:
        """``wake_up``, then the requests held while asleep are admitted (at the pushed version)."""
        self.wake_up()
        self._start_serving()
        self._serving.set()

    @property
    def asleep(self) -> bool:
        return self._sleep is not None

    @property
    def sleep_state(self) -> SleepState | None:
        """What ``sleep`` released (None: awake)."""
        return self._sleep

    @property
    def version(self) -> int:
        return self._version

    @property
    def kv_cache_bytes(self) -> int:
        """The KV / index / latent pools' bytes; asleep, those of the released runner
        tensors (pools, derived weights, decode buffers: ``rollout/sleep.py``) still alive (0)."""
        return self.runner.cache_bytes if self._sleep is None else pool_bytes_held(self._sleep)

    # -- requests ---------------------------------------------------------------------------
    def make_sequence(self, prompt_ids: list[int], params: SamplingParams, waiter=None,
                      image_patches: torch.Tensor | None = None) -> Sequence:
        """``image_patches`` [P, patch_dim]: one row per ``<image>`` id of ``prompt_ids``, prefilled
        into those slots (an ``<image>`` the model samples later gets a zero row, as in the learner)."""
        if not prompt_ids:
            raise ValueError("prompt_ids needs at least one token")
        check_awake(self)
        image_keys = self._image_keys(prompt_ids, image_patches)
        need = self.block_manager.blocks_for(len(prompt_ids) + params.max_tokens)
        if need > self.config.num_blocks:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens + max_tokens={params.max_tokens} needs {need} "
                             f"KV blocks; the engine has num_blocks={self.config.num_blocks}")
        gen = None
        if params.seed is not None:
            gen = torch.Generator(self.runner.device).manual_seed(params.seed)  # sampled where the logits are
        self.stats.prompt_tokens += len(prompt_ids)
        return Sequence(seq_id=next(self._ids), token_ids=list(prompt_ids), params=params,
                        stops=frozenset(params.stop_token_ids if self.config.ignore_eos
                                        else (self.tok.im_end_id, *params.stop_token_ids)), gen=gen,
                        out=GenerationOutput([], [], [], "length", -1), waiter=waiter,
                        images=image_patches, image_keys=image_keys)

    def _image_keys(self, prompt_ids: list[int], image_patches: torch.Tensor | None) -> dict[int, int]:
        """Position of each ``<image>`` id -> a digest of its patch row (the prefix cache's key)."""
        if image_patches is None:
            return {}
        cfg = self.model.config
        if not cfg.image_patch_dim:
            raise ValueError("image_patches given but MoEConfig.image_patch_dim is 0 (a text-only model)")
        slots = [p for p, t in enumerate(prompt_ids) if t == cfg.image_token_id]
        if tuple(image_patches.shape) != (len(slots), cfg.image_patch_dim):
            raise ValueError(f"image_patches must be [<image> ids in the prompt = {len(slots)}, {cfg.image_patch_dim}], "
                             f"got {tuple(image_patches.shape)}")
        rows = image_patches.detach().cpu().contiguous().numpy()
        return {p: int.from_bytes(hashlib.blake2b(row.tobytes(), digest_size=8).digest(), "little")
                for p, row in zip(slots, rows)}

    def add_request(self, prompt_ids: list[int], params: SamplingParams, waiter=None,
                    image_patches: torch.Tensor | None = None) -> Sequence:
        seq = self.make_sequence(prompt_ids, params, waiter, image_patches)
        self._inbox.append(seq)
        return seq

    # -- the hot loop -----------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """One forward of everything scheduled; → the sequences whose turn ended."""
        with self._lock:
            check_awake(self)
            t0 = time.perf_counter()
            while self._inbox:
                self.scheduler.add(self._inbox.popleft())
            batch = self.scheduler.schedule(time.monotonic())
            self._warn_pressure()
            if not batch:
                return []
            t1 = time.perf_counter()
            logits_RV, ends, routed_NLk = self.runner.run(batch, self.config.return_routed_experts)
            self.stats.forward_s += time.perf_counter() - t1
            row = 0
            if routed_NLk is not None:
                routed_NLk = routed_NLk.to(ROUTE_DTYPE)
            for seq, n in batch:
                if routed_NLk is not None:
                    seq.record_routes(routed_NLk[row:row + n])
                row += n
                seq.num_computed += n
                self.scheduler.register_computed(seq)
            self.stats.computed_tokens += row
            done = self._emit([batch[i][0] for i in ends], logits_RV)
            self.stats.steps += 1
            self.stats.step_s += time.perf_counter() - t0
            return done

    def _warn_pressure(self) -> None:
        """One line on stderr when the KV pool ran out since the last warning (at most one a minute):
        preempted sequences and evicted sessions recompute their context, so a pool too small for the
        concurrent contexts turns each turn into a prefill from token 0 (it looks like a slow engine)."""
        s, (seen, at) = self.scheduler, self._warned
        if s.num_dropped == seen or (now := time.monotonic()) - at < PRESSURE_WARN_S:
            return
        self._warned = (s.num_dropped, now)
        cfg, computed = self.config, max(self.stats.computed_tokens, 1)
        print(f"engine: KV pool full ({cfg.num_blocks} blocks x {cfg.block_size} = {cfg.num_blocks * cfg.block_size} "
              f"token slots): {s.num_dropped} caches dropped so far ({s.num_preempted} running sequences preempted, "
              f"the rest idle or queued sessions), {s.dropped_tokens} computed tokens to recompute "
              f"({100 * s.dropped_tokens / computed:.0f}% of the {self.stats.computed_tokens} computed); "
              f"raise rollout.num_blocks (or lower envs.max_concurrent_episodes)", file=sys.stderr, flush=True)

    def _emit(self, seqs: list[Sequence], logits_RV: torch.Tensor) -> list[Sequence]:
        """Sample one token per sequence; end the turns that stop or reach ``max_tokens``."""
        tokens, logprobs = sample_rows(logits_RV, [s.params for s in seqs], [s.gen for s in seqs])
        done, now = [], time.monotonic()
        for seq, token, logprob in zip(seqs, tokens, logprobs):
            out = seq.out
            out.token_ids.append(token)
            out.logprobs.append(logprob)
            out.sampled.append(1)
            if out.policy_version < 0:
                out.policy_version = self._version
            seq.token_ids.append(token)
            if token in seq.stops:
                out.finish_reason = "stop"
            elif len(out.token_ids) < seq.params.max_tokens:
                continue
            if seq.routed is not None:  # routing replay: positions routed_from .. len - 2
                out.routed_from = seq.routed_from
                # kept on the engine's device while the turn runs; the output crosses processes: a host copy
                out.routed_experts = seq.routed[seq.routed_from:len(seq) - 1].to(HOST, copy=True)
            self.scheduler.finish(seq, now)
            done.append(seq)
        return done

    def generate_batch(self, prompts: list[list[int]], params: list[SamplingParams],
                       images: list[torch.Tensor | None] | None = None) -> list[GenerationOutput]:
        """Synchronous: run ``prompts`` (with any requests already queued) to the end of their turns."""
        if len(prompts) != len(params):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        images = images or [None] * len(prompts)
        seqs = [self.make_sequence(p, sp, image_patches=im) for p, sp, im in zip(prompts, params, images)]
        self._inbox.extend(seqs)
        pending = set(map(id, seqs))
        while pending:
            for seq in self.step():
                pending.discard(id(seq))
        return [s.out for s in seqs]

    # -- async front (the RolloutEngine protocol) ------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       image_patches: torch.Tensor | None = None) -> GenerationOutput:
        self._start_serving()
        while not self._serving.is_set():  # colocated: held while the engine sleeps (sleep_when_idle)
            await self._serving.wait()
        fut = asyncio.get_running_loop().create_future()
        self.add_request(prompt_ids, params, fut, image_patches)
        self._wake.set()
        return await fut

    def _start_serving(self) -> None:
        """The serve loop and its events, on the running event loop (once)."""
        if self._loop_task is None:
            self._wake, self._serving = asyncio.Event(), asyncio.Event()
            self._serving.set()
            self._loop_task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self._sleep is not None or not (self._inbox or self.scheduler.has_work()):
                self._wake.clear()
                await self._wake.wait()
            try:
                done = await loop.run_in_executor(None, self.step)
            except Exception as e:  # fail every request in flight; keep serving new ones
                self._fail_all(e)
                continue
            for seq in done:
                if seq.waiter is not None and not seq.waiter.done():
                    seq.waiter.set_result(seq.out)

    def _fail_all(self, error: Exception) -> None:
        with self._lock:
            seqs = [*self._inbox, *self.scheduler.waiting, *self.scheduler.running]
            self._inbox.clear()
            self.scheduler.preempt_all()
            self.scheduler.waiting.clear()
        for seq in seqs:
            if seq.waiter is not None and not seq.waiter.done():
                seq.waiter.set_exception(error)

    async def close(self) -> None:
        """Stop the background loop (requests in flight are cancelled)."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
            self._loop_task = None

    # -- weights ----------------------------------------------------------------------------
    def update_weights(self, version: int, bundle) -> None:
        """Apply a whole push (``weight_sync.apply_bundle``: checked, then written in place) between two
        engine steps and serve ``version`` from the next one; on the ``triton`` table the routed experts
        also stay MXFP4-resident as pushed (``weight_sync.hold_mxfp4_experts``), for its MXFP4 MoE kernel.
        Decode graphs are dropped (``DecodeGraphs.reset``) and captured again at their next use."""
        with self._lock:  # between steps
            apply_bundle(self.model, bundle, expected_version=version)
            if self.model.kernels.backend == "triton":  # its MoE kernel reads the pushed MXFP4 experts as they came
                hold_mxfp4_experts(self.model, bundle)
            self._version = version
            if self.scheduler is None:  # asleep: wake_up builds the scheduler at this version, with no caches
                return
            if self.runner.graphs is not None:  # captured graphs read the old derived copies and MXFP4 buffers
                self.runner.graphs.reset()
            self.scheduler.version = version
            if self.config.live_sessions == "reprefill":
                self.scheduler.preempt_all()
