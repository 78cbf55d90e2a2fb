"""``jointrl serve``: the policy behind OpenAI- and Anthropic-compatible HTTP APIs (aiohttp).

    GET  /health                          {"status": "ok", "policy_version": v}
    GET  /v1/models                       the served model
    POST /v1/chat/completions             OpenAI Chat Completions (openai_api.py), SSE with "stream"
    POST /v1/messages                     Anthropic Messages (anthropic_api.py), SSE with "stream"
    POST /v1/conversations/{id}/finish    end a conversation; with serve.record_path set, append it
                                          as a Trajectory JSON line (body: reward, task_id, ...)

Every reply carries ``conversation_id`` (also the ``X-Conversation-Id`` header): the token
record a follow-up request extends (``recorder.py``). The engine is reached only through the
``RolloutEngine`` protocol; it is built like the rollout worker's (``rollout.backend``) and
loaded through the weight push (``build_bundle`` / ``update_weights``, MXFP4 experts iff
``rollout.quantize_experts``), so it serves exactly what training rollouts would run.
``checkpoint``: an HF directory (``model/hf.load_hf``), a DeepSpeed checkpoint directory of a
run (``.../checkpoints`` -- its ``latest`` tag -- or ``.../checkpoints/step_N``; policy version
N), or none (the untrained ``model`` from config). Streaming sends the turn's chunks once the
engine returns the turn (``generate`` yields whole turns).

Client mistakes are 4xx JSON errors in each API's shape naming the field; an unexpected
failure is a 500 in the same shape; the server keeps serving either way.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import signal
import sys
from pathlib import Path
from typing import Any

import hydra
import torch
from aiohttp import web
from omegaconf import DictConfig

from jointrl.model.hf import load_hf
from jointrl.model.moe_transformer import MoETransformer
from jointrl.rl.build import build_model, build_template
from jointrl.rl.config import Config, register_schemas, to_config
from jointrl.rl.device import HOST
from jointrl.rl.rollout import anthropic_api, openai_api
from jointrl.rl.rollout.chat import ChatService, RequestError, ServiceLimits
from jointrl.rl.rollout.engine import RolloutEngine
from jointrl.rl.rollout.recorder import ConversationStore
from jointrl.rl.rollout.worker import RolloutWorker
from jointrl.rl.types import FinishReason
from jointrl.rl.weight_sync import build_bundle, is_routed_expert

log = logging.getLogger("jointrl.serve")


def load_policy(cfg: Config, checkpoint: str | None) -> tuple[MoETransformer | None, int]:
    """(weights to serve, policy version); (None, 0) when ``checkpoint`` is None (the untrained model)."""
    if not checkpoint:
        return None, 0
    path = Path(checkpoint)
    if (path / "config.json").is_file():
        return load_hf(path), 0
    if (path / "latest").is_file():
        path = path / (path / "latest").read_text().strip()
    states = sorted(path.glob("mp_rank_*_model_states.pt"))
    if not states:
        raise ValueError(f"checkpoint {checkpoint!r} is neither an HF directory (config.json) nor a DeepSpeed "
                         "checkpoint (latest, or mp_rank_00_model_states.pt)")

    saved = torch.load(states[0], map_location="cpu", weights_only=False)
    model = build_model(cfg, HOST)  # the engine runs on the host (rl/rollout/worker.py)
    model.load_state_dict(saved["module"])
    match = re.search(r"(\d+)$", path.name)
    return model, int(saved.get("step", match.group(1) if match else 0))


def build_engine(cfg: Config, checkpoint: str | None) -> RolloutEngine:
    """The rollout worker's engine (``rollout.backend``), holding the checkpoint's weights."""
    engine = RolloutWorker(cfg).engine
    model, version = load_policy(cfg, checkpoint)
    if model is not None:
        quantize = is_routed_expert if cfg.rollout.quantize_experts else (lambda name, t: False)
        engine.update_weights(version, build_bundle(model.state_dict(), version, is_quantized=quantize))
    return engine


class PolicyServer:
    def __init__(self, engine: RolloutEngine, cfg: Config) -> None:
        sc = cfg.serve
        self.engine, self.cfg, self.template = engine, cfg, build_template(cfg)
        self.tiers: dict[str, int | None] = dict(cfg.rollout.thinking_budget)
        self.store = ConversationStore(self.template, sc.max_conversations, sc.record_path)
        limits = ServiceLimits(max_context=cfg.rollout.max_context, default_max_tokens=sc.default_max_tokens,
                               temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k)
        self.service = ChatService(engine, self.template, self.store, limits, self.tiers[sc.default_thinking_budget])

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.serve.max_request_bytes, middlewares=[json_errors])
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/messages", self.messages)
        app.router.add_post("/v1/conversations/{conv_id}/finish", self.finish)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _cleanup(self, app: web.Application) -> None:
        self.store.close()
        close = getattr(self.engine, "close", None)
        if close is not None:
            await close()

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "policy_version": self.engine.version,
                                  "conversations": len(self.store)})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.cfg.serve.model_name, "object": "model", "created": 0, "owned_by": "jointrl"}]})

    async def _body(self, request: web.Request) -> Any:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise RequestError(f"request body over {self.cfg.serve.max_request_bytes} bytes", None, 413) from None
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(f"the request body is not valid JSON ({e})", None) from None

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        try:
            req, opts = openai_api.parse_request(await self._body(request), self.tiers)
            reply = await self.service.complete(req)
        except RequestError as e:
            return web.json_response(openai_api.error_body(e), status=e.status)
        except Exception as e:  # keep serving; the client gets the failure in the API's shape
            log.exception("chat completion failed")
            return web.json_response(openai_api.error_body(RequestError(repr(e), None, 500, "server_error")), status=500)
        model, headers = opts["model"] or self.cfg.serve.model_name, {"X-Conversation-Id": reply.conversation_id}
        if not req.stream:
            return web.json_response(openai_api.response(reply, opts, model, self.template.tok), headers=headers)
        resp = await self._sse(request, headers)
        for chunk in openai_api.stream_chunks(reply, opts, model, self.template.tok):
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def messages(self, request: web.Request) -> web.StreamResponse:
        try:
            req, opts = anthropic_api.parse_request(await self._body(request), self.tiers)
            reply = await self.service.complete(req)
        except RequestError as e:
            return web.json_response(anthropic_api.error_body(e), status=e.status)
        except Exception as e:
            log.exception("messages request failed")
            return web.json_response(anthropic_api.error_body(RequestError(repr(e), None, 500, "api_error")), status=500)
        model, headers = opts["model"] or self.cfg.serve.model_name, {"X-Conversation-Id": reply.conversation_id}
        if not req.stream:
            return web.json_response(anthropic_api.response(reply, model), headers=headers)
        resp = await self._sse(request, headers)
        for name, data in anthropic_api.stream_events(reply, model):
            await resp.write(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode())
        await resp.write_eof()
        return resp

    async def _sse(self, request: web.Request, headers: dict[str, str]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers})
        await resp.prepare(request)
        return resp

    async def finish(self, request: web.Request) -> web.Response:
        """Body (all optional): reward, reward_info, task_id, group_id, domain, tier, finish_reason."""
        try:
            body = await self._body(request) if request.can_read_body else {}
            if not isinstance(body, dict):
                raise RequestError("the request body must be a JSON object", None)
            fields = {}
            for key, types in (("reward", (int, float)), ("reward_info", dict), ("task_id", str), ("group_id", str),
                               ("domain", str), ("tier", str), ("finish_reason", str)):
                value = openai_api._field(body, key, types, "")
                if value is not None:
                    fields[key] = value
            if "finish_reason" in fields:
                try:
                    fields["finish_reason"] = FinishReason(fields["finish_reason"])
                except ValueError:
                    raise RequestError(f"'finish_reason' must be one of {[str(r) for r in FinishReason]}",
                                       "finish_reason") from None
            conv_id = request.match_info["conv_id"]
            try:
                traj = self.store.finish(conv_id, **fields)
            except KeyError:
                raise RequestError(f"no open conversation {conv_id!r}", "conversation_id", 404, "not_found_error") from None
        except RequestError as e:
            return web.json_response(openai_api.error_body(e), status=e.status)
        return web.json_response({"conversation_id": conv_id, "recorded": self.store.record_path is not None,
                                  "trajectory": traj.to_json()})


@web.middleware
async def json_errors(request: web.Request, handler) -> web.StreamResponse:
    """Unknown routes and wrong methods answer in the OpenAI error shape, not aiohttp's text."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        body = openai_api.error_body(RequestError(f"{request.method} {request.path}: {e.reason}", None, e.status))
        return web.json_response(body, status=e.status)


async def serve(cfg: Config) -> None:
    """Build the engine, bind ``serve.host:serve.port`` and serve until cancelled."""
    engine = build_engine(cfg, cfg.checkpoint)
    server = PolicyServer(engine, cfg)
    app = server.app()
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.serve.host, cfg.serve.port)
    await site.start()
    port = runner.addresses[0][1]
    print(f"jointrl serve: listening on http://{cfg.serve.host}:{port} (policy version {engine.version}, "
          f"recording to {cfg.serve.record_path or 'nowhere'})", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


register_schemas()


@hydra.main(config_path="../../conf", config_name="config", version_base=None)
def main(raw: DictConfig) -> None:
    """``jointrl serve [overrides]``: e.g. ``checkpoint=runs/default/checkpoints serve.port=8000``."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    asyncio.run(serve(to_config(raw)))


if __name__ == "__main__":
    main()
