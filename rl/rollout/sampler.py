"""``SimpleSampler``: the skeleton's batched sampler with a KV cache and per-token log-probs.

Requests that arrive together (one asyncio queue) are left-padded into one batch, prefilled
once, then decoded token by token with a growing KV cache. It has no continuous batching,
sessions or paged memory (the fast engine, issue #5, adds those) but honours the whole
``RolloutEngine`` contract: sampling (temperature, top-k, top-p, per-request seed, stop
tokens, max_tokens), per-token log-probs and policy versions (the thinking budget is the
turn's, ``rl/rollout/turn.py``).

With ``record_routes=True`` it also returns the experts each token was routed to (routing
replay, R3): ``GenerationOutput.routed_experts`` [n, L, k] holds the ids of every token this
call ran through the model, in order — the whole prompt (one prefill) then every generated
token but the last (each fed back as the next step's input; the last one never is).

Device: the model's; the batch's ids, masks and each seeded row's generator are made there.

Log-prob convention (the learner uses the same): ``log_softmax(logits / T)`` of the sampled
token, before top-k / top-p filtering; ``T = 1`` when sampling greedily (``temperature=0``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch

from jointrl.model import KVCache, MoETransformer
from jointrl.model.rope import position_ids
from jointrl.model.tokenizer import ByteTokenizer
from jointrl.rl.device import HOST
from jointrl.rl.image_inputs import slot_patches
from jointrl.rl.types import ROUTE_DTYPE, GenerationOutput, SamplingParams
from jointrl.rl.weight_sync import apply_bundle


@dataclass(slots=True)
class _Row:
    params: SamplingParams
    gen: torch.Generator | None
    stops: frozenset[int]
    done: bool = False
    finish: str = "length"


class SimpleSampler:
    def __init__(self, model: MoETransformer, tokenizer: ByteTokenizer, max_batch: int = 64,
                 batch_wait_s: float = 0.005, record_routes: bool = False) -> None:
        self.model = model.eval()
        self.record_routes = record_routes
        self.tok = tokenizer
        self.max_batch = max_batch
        self.batch_wait_s = batch_wait_s
        self._version = 0
        self._queue: asyncio.Queue | None = None
        self._loop_task: asyncio.Task | None = None

    @property
    def version(self) -> int:
        return self._version

    def update_weights(self, version: int, bundle) -> None:
        apply_bundle(self.model, bundle, expected_version=version)
        self._version = version

    # -- async front: requests that arrive together are batched --------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       image_patches: torch.Tensor | None = None) -> GenerationOutput:
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._loop_task = asyncio.get_running_loop().create_task(self._serve())
        fut = asyncio.get_running_loop().create_future()
        await self._queue.put((prompt_ids, params, image_patches, fut))
        return await fut

    async def close(self) -> None:
        """Stop the batching loop (requests still queued are cancelled)."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
            self._loop_task = self._queue = None

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            pending = [await self._queue.get()]
            await asyncio.sleep(self.batch_wait_s)  # let concurrent requests join the batch
            while not self._queue.empty() and len(pending) < self.max_batch:
                pending.append(self._queue.get_nowait())
            try:
                outs = await loop.run_in_executor(
                    None, self.generate_batch, [p[0] for p in pending], [p[1] for p in pending], [p[2] for p in pending])
            except Exception as e:  # hand the failure to every waiter; keep serving
                for *_, fut in pending:
                    fut.set_exception(e)
                continue
            for (*_, fut), out in zip(pending, outs):
                fut.set_result(out)

    # -- the batch itself ------------------------------------------------------------------
    @torch.no_grad()
    def generate_batch(self, prompts: list[list[int]], params: list[SamplingParams],
                       images: list[torch.Tensor | None] | None = None) -> list[GenerationOutput]:
        """``images[b]``: prompt b's screenshot patches (one row per ``<image>`` id), or None."""
        if len(prompts) != len(params):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        B, S = len(prompts), max(len(p) for p in prompts)
        pad = self.tok.pad_id
        dev = next(self.model.parameters()).device
        # left padding: every row's last token is at S-1 (built on the host, one copy to the device)
        ids_BS = torch.tensor([[pad] * (S - len(p)) + list(p) for p in prompts], dtype=torch.long, device=dev)
        mask_BS = torch.tensor([[False] * (S - len(p)) + [True] * len(p) for p in prompts], device=dev)
        pos_BS = position_ids(mask_BS)
        rows = [_Row(params=sp, gen=_generator(sp.seed, dev), stops=frozenset((self.tok.im_end_id, *sp.stop_token_ids)))
                for sp in params]
        outs = [GenerationOutput([], [], [], "length", self._version) for _ in prompts]

        dtype = next(self.model.parameters()).dtype
        cache = KVCache.empty(self.model.config, B, dtype, dev)
        out = self.model(ids_BS, position_ids=pos_BS, attention_mask=mask_BS, cache=cache,
                         image_patches=self._patches(prompts, images or [None] * B))
        logits_BV = out.logits[:, -1]
        routes = None  # per row: route chunks [n, L, k], the prompt's then one per step that fed a token
        if self.record_routes:
            routes = [[out.topk_ids[b, S - len(p):].to(ROUTE_DTYPE)] for b, p in enumerate(prompts)]
        next_pos_B = pos_BS[:, -1] + 1
        for _ in range(max(sp.max_tokens for sp in params)):
            step_ids = [self._pick(row, logits_BV[b], outs[b]) if not row.done else pad for b, row in enumerate(rows)]
            if all(r.done for r in rows):
                break
            mask_BS = torch.cat([mask_BS, mask_BS.new_ones((B, 1))], dim=1)
            out = self.model(torch.tensor(step_ids, device=dev)[:, None], position_ids=next_pos_B[:, None],
                             attention_mask=mask_BS, cache=cache, image_patches=self._patches([[t] for t in step_ids]))
            logits_BV = out.logits[:, -1]
            if routes is not None:
                step_NLk = out.topk_ids[:, 0].to(ROUTE_DTYPE)
                for b, o in enumerate(outs):  # rows still generating fed their last token; keep P + n - 1
                    if sum(map(len, routes[b])) < len(prompts[b]) + len(o.token_ids):
                        routes[b].append(step_NLk[b:b + 1])
            next_pos_B = next_pos_B + 1
        for b, (row, o) in enumerate(zip(rows, outs)):
            o.finish_reason = row.finish
            if routes is not None:
                o.routed_experts = torch.cat(routes[b])[:len(prompts[b]) + len(o.token_ids) - 1].to(HOST)  # crosses processes
        return outs

    def _patches(self, rows: list[list[int]], images: list[torch.Tensor | None] | None = None) -> torch.Tensor | None:
        """``image_patches`` for a forward over ``rows`` (row-major; ``slot_patches``' rule), or None
        for a text-only model. Decode steps pass no images: a sampled ``<image>`` gets a zero row."""
        cfg = self.model.config
        images = images or [None] * len(rows)
        if not cfg.image_patch_dim:
            if any(p is not None for p in images):
                raise ValueError("image_patches given but MoEConfig.image_patch_dim is 0 (a text-only model)")
            return None
        patches = torch.cat([slot_patches(r, p, cfg.image_token_id, cfg.image_patch_dim) for r, p in zip(rows, images)])
        return patches.to(next(self.model.parameters()).device)  # from the host: one copy (none on the host)

    def _pick(self, row: _Row, logits_V: torch.Tensor, out: GenerationOutput) -> int:
        """Sample this row's next token, record it, and update the row's state."""
        sp = row.params
        token, logprob = _sample(logits_V.double(), sp, row.gen)
        out.token_ids.append(token)
        out.logprobs.append(logprob)
        out.sampled.append(1)
        if token in row.stops:
            row.done, row.finish = True, "stop"
        elif len(out.token_ids) >= sp.max_tokens:
            row.done, row.finish = True, "length"
        return token


def _generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    g = torch.Generator(device)
    g.manual_seed(seed)
    return g


def _sample(logits_V: torch.Tensor, sp: SamplingParams, gen: torch.Generator | None) -> tuple[int, float]:
    """(token, log-prob under softmax(logits / T)). Greedy when temperature == 0."""
    if sp.temperature == 0:
        token = int(torch.argmax(logits_V))
        return token, float(torch.log_softmax(logits_V, -1)[token])
    logp_V = torch.log_softmax(logits_V / sp.temperature, -1)
    filtered_V = logp_V.clone()
    if sp.top_k > 0 and sp.top_k < filtered_V.numel():
        kth = torch.topk(filtered_V, sp.top_k).values[-1]
        filtered_V[filtered_V < kth] = -torch.inf
    if sp.top_p < 1.0:
        sorted_V, order = torch.sort(filtered_V, descending=True)
        cum = sorted_V.exp().cumsum(-1)
        drop = cum - sorted_V.exp() >= sp.top_p  # keep the smallest prefix reaching top_p
        filtered_V[order[drop]] = -torch.inf
    token = int(torch.multinomial(torch.softmax(filtered_V, -1).float(), 1, generator=gen))
    return token, float(logp_V[token])
