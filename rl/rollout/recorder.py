"""Session-aware token recording: the conversations the server has seen, in token space.

An external agent speaks text (OpenAI / Anthropic messages); the learner needs the exact
tokens the engine produced and saw. ``ConversationStore`` keeps, per conversation, every
token id with its loss mask, log-prob and policy version, and where each message ends in
that token stream. When a request's messages extend a stored conversation, the store reuses
the stored tokens for the matching prefix -- a generated assistant turn re-enters the context
exactly as it was sampled (thinking, non-canonical JSON, a forced ``</think>``), never
re-tokenized -- and renders only the new messages with ``ChatTemplate.continuation``:

    prompt = conversation.token_ids[: end of the last matching message] + continuation(new messages)

which is what ``rl/agent_loop.run_episode`` does between turns, so a conversation driven
through the server records the same ``Trajectory`` as the agent loop (tested).

Matching. Messages compare by role, content and tool calls (name, arguments, and the call
ids the server handed out); an assistant message sent back without its reasoning matches the
recorded one (many scaffolds drop ``reasoning_content``), and the recorded thinking stays in
context. A client may name the conversation (``conversation_id``, returned with every reply)
to match against it alone; otherwise a conversation the request extends entirely wins, then
the longest matching prefix, then the most recent -- text alone cannot tell apart two
samples that wrote the same words with different log-probs, so agents that record training
data should send the id;
a request that extends a conversation fully continues it under the same id, one that
diverges inside it starts a new conversation (a fork) sharing the prefix tokens. A generated
turn that did not end with ``<|im_end|>`` (harmony: ``<|return|>`` or ``<|call|>``; cut by max_tokens) is never reused: the match
stops before it and the message is re-rendered. The first divergence point is logged.

Recording. With ``record_path`` set, ``finish(id, ...)`` appends the conversation as one
``Trajectory`` JSON line (``Trajectory.to_json``, the trainer's dump format); ``close()``
writes the conversations never finished, flagged ``reward_info.finished = false``. The store
holds at most ``max_conversations`` (least recently used evicted, and recorded if
recording).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jointrl.envs.base import Message, ToolCall, ToolSpec
from jointrl.model.chat_template import ChatTemplate
from jointrl.rl.types import FinishReason, GenerationOutput, Trajectory, tensor_from_json

log = logging.getLogger("jointrl.serve")


@dataclass(slots=True)
class Conversation:
    """One conversation in token space. ``ends[i]``: offset just past message i's ``<|im_end|>``
    (None where the message may not be reused: a generated turn cut before ``<|im_end|>``)."""

    id: str
    tools_key: str
    messages: list[Message]
    ends: list[int | None]
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    policy_version: list[int]
    num_turns: int = 0
    last_finish: str = "stop"
    revision: int = 0
    last_used: float = field(default_factory=time.monotonic)


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request resolved against the store: the prompt ids and where they came from."""

    prompt_ids: list[int]
    base: Conversation | None  # the conversation whose tokens were reused
    base_revision: int
    matched: int  # messages reused from ``base``
    reused_tokens: int
    messages: list[Message]
    tools_key: str
    ends: list[int | None]  # per request message


def tools_key(tools: list[ToolSpec]) -> str:
    return json.dumps([t.to_openai() for t in tools], sort_keys=True)


def same_message(request: Message, recorded: Message) -> bool:
    """Does ``request`` (sent by a client) stand for ``recorded`` (what the store holds)?"""
    if request.role != recorded.role or request.content != recorded.content:
        return False
    if request.role != "assistant":
        return True
    if request.reasoning and request.reasoning != recorded.reasoning:
        return False
    if len(request.tool_calls) != len(recorded.tool_calls):
        return False
    return all(a.name == b.name and a.arguments == b.arguments and (not a.id or not b.id or a.id == b.id)
               for a, b in zip(request.tool_calls, recorded.tool_calls))


class ConversationStore:
    def __init__(self, template: ChatTemplate, max_conversations: int = 1024,
                 record_path: str | Path | None = None) -> None:
        if max_conversations < 1:
            raise ValueError(f"max_conversations must be >= 1, got {max_conversations}")
        self.template = template
        self.max_conversations = max_conversations
        self.record_path = Path(record_path) if record_path else None
        self._convs: dict[str, Conversation] = {}
        self._lock = threading.Lock()
        if self.record_path is not None:
            self.record_path.parent.mkdir(parents=True, exist_ok=True)

    def __len__(self) -> int:
        return len(self._convs)

    def get(self, conv_id: str) -> Conversation | None:
        return self._convs.get(conv_id)

    # -- a request: resolve its prompt ids ---------------------------------------------------
    def prepare(self, messages: list[Message], tools: list[ToolSpec], conversation_id: str | None = None) -> Prepared:
        """Prompt ids for ``messages``; ``conversation_id`` restricts the match to that conversation.

        Raises ``KeyError`` for an unknown ``conversation_id``."""
        key = tools_key(tools)
        with self._lock:
            if conversation_id is not None and conversation_id not in self._convs:
                raise KeyError(conversation_id)
            best, k = self._best_match(messages, key, conversation_id)
            if best is None:
                ends = self._render_ends(messages, tools)
                prompt = self.template.render(messages, tools)
                return Prepared(prompt, None, 0, 0, 0, list(messages), key, ends)
            cut = best.ends[k - 1]
            assert cut is not None
            prompt = best.token_ids[:cut] + self.template.continuation(messages[k:])
            ends = best.ends[:k] + self._continuation_ends(cut, messages[k:])
            if k < len(best.messages):
                log.info("request diverges from conversation %s at message %d (token %d): %s", best.id, k, cut,
                         "new branch" if k < len(messages) else "regenerating")
            else:
                log.debug("request extends conversation %s after message %d (token %d)", best.id, k, cut)
            return Prepared(prompt, best, best.revision, k, cut, list(messages), key, ends)

    def _best_match(self, messages: list[Message], key: str, only: str | None) -> tuple[Conversation | None, int]:
        best, best_rank = None, (False, 0, 0.0)
        for conv in self._convs.values():
            if conv.tools_key != key or (only is not None and conv.id != only):
                continue
            k = 0
            while (k < len(messages) and k < len(conv.messages) and conv.ends[k] is not None
                   and same_message(messages[k], conv.messages[k])):
                k += 1
            rank = (k == len(conv.messages), k, conv.last_used)
            if k > 0 and rank > best_rank:
                best, best_rank = conv, rank
        return best, best_rank[1]

    def _render_ends(self, messages: list[Message], tools: list[ToolSpec]) -> list[int | None]:
        full = self.template.render(messages, tools)
        return self._ends(full, 0, [self.template.render(messages[: i + 1], tools, add_generation_prompt=False)
                                    for i in range(len(messages))])

    def _continuation_ends(self, cut: int, messages: list[Message]) -> list[int | None]:
        full = self.template.continuation(messages)
        return self._ends(full, cut, [self.template.continuation(messages[: i + 1], add_generation_prompt=False)
                                      for i in range(len(messages))])

    def _ends(self, full: list[int], base: int, prefixes: list[list[int]]) -> list[int | None]:
        """Message i ends just past the last end token of ``prefixes[i]`` (the messages up to i
        rendered alone), if that rendering is a prefix of ``full``; else None (not reusable: a
        template that renders a message differently when more follow, e.g. Qwen3's grouped tool
        responses)."""
        marks, ends = _end_ids(self.template.tok), []
        for ids in prefixes:
            end = next((len(ids) - j for j, i in enumerate(reversed(ids)) if i in marks), None)
            ends.append(base + end if end is not None and ids[:end] == full[:end] else None)
        return ends

    # -- a generated turn: record it ---------------------------------------------------------
    def commit(self, prep: Prepared, out: GenerationOutput, reply: Message) -> Conversation:
        """Record ``prompt + out`` as the conversation's new state; returns the conversation."""
        n_prompt = len(prep.prompt_ids)
        ended = bool(out.token_ids) and out.token_ids[-1] in _end_ids(self.template.tok, generated=True)
        with self._lock:
            base = prep.base
            if base is not None:
                mask, lps, vers = (base.loss_mask[: prep.reused_tokens], base.logprobs[: prep.reused_tokens],
                                   base.policy_version[: prep.reused_tokens])
            else:
                mask, lps, vers = [], [], []
            extra = n_prompt - len(mask)
            mask, lps, vers = mask + [0] * extra, lps + [0.0] * extra, vers + [-1] * extra
            extend = (base is not None and base.id in self._convs and base.revision == prep.base_revision
                      and prep.matched == len(base.messages))
            conv = base if extend else Conversation(
                id=f"conv-{uuid.uuid4().hex[:16]}", tools_key=prep.tools_key, messages=[], ends=[],
                token_ids=[], loss_mask=[], logprobs=[], policy_version=[])
            conv.messages = [*prep.messages, reply]
            conv.ends = [*prep.ends, n_prompt + len(out.token_ids) if ended else None]
            conv.token_ids = [*prep.prompt_ids, *out.token_ids]
            conv.loss_mask = mask + list(out.sampled)
            conv.logprobs = lps + list(out.logprobs)
            conv.policy_version = vers + [out.policy_version if s else -1 for s in out.sampled]
            conv.num_turns = sum(m.role == "assistant" for m in conv.messages)
            conv.last_finish = out.finish_reason
            conv.revision += 1
            conv.last_used = time.monotonic()
            self._convs[conv.id] = conv
            evicted = self._evict()
        for old in evicted:
            self._write(old, {}, finished=False)
        return conv

    def _evict(self) -> list[Conversation]:
        out = []
        while len(self._convs) > self.max_conversations:
            oldest = min(self._convs.values(), key=lambda c: c.last_used)
            out.append(self._convs.pop(oldest.id))
        return out

    # -- recording ---------------------------------------------------------------------------
    def trajectory(self, conv: Conversation, **fields: Any) -> Trajectory:
        """The conversation as a ``Trajectory`` (``fields`` fill reward, task_id, ... )."""
        finish = FinishReason.STOP if conv.last_finish == "stop" else FinishReason.LENGTH
        traj = Trajectory(token_ids=list(conv.token_ids), loss_mask=list(conv.loss_mask), logprobs=list(conv.logprobs),
                          policy_version=list(conv.policy_version), domain="server", task_id=conv.id,
                          group_id=conv.id, finish_reason=finish, messages=list(conv.messages),
                          num_turns=conv.num_turns,
                          num_tool_calls=sum(len(m.tool_calls) for m in conv.messages if m.role == "assistant"))
        return dataclasses.replace(traj, **fields) if fields else traj

    def finish(self, conv_id: str, **fields: Any) -> Trajectory:
        """End a conversation: remove it and (when recording) append it as a Trajectory line."""
        with self._lock:
            conv = self._convs.pop(conv_id, None)
        if conv is None:
            raise KeyError(conv_id)
        return self._write(conv, fields, finished=True)

    def _write(self, conv: Conversation, fields: dict[str, Any], finished: bool) -> Trajectory:
        info = dict(fields.pop("reward_info", {}) or {})
        info["finished"] = finished
        traj = self.trajectory(conv, reward_info=info, **fields)
        if self.record_path is not None:
            with self._lock, self.record_path.open("a") as f:
                f.write(json.dumps(traj.to_json()) + "\n")
        return traj

    def close(self) -> None:
        """Record every conversation not finished yet (``reward_info.finished = false``)."""
        with self._lock:
            convs, self._convs = list(self._convs.values()), {}
        if self.record_path is not None:
            for conv in convs:
                self._write(conv, {}, finished=False)


def read_trajectories(path: str | Path) -> list[Trajectory]:
    """Trajectories from a JSONL file written by the recorder or the trainer's dumps."""
    out = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        d = json.loads(line)
        msgs = []
        for m in d.pop("messages", []):
            calls = [ToolCall(c["function"]["name"], c["function"]["arguments"], c.get("id", ""))
                     for c in m.get("tool_calls", [])]
            msgs.append(Message(role=m["role"], content=m.get("content", ""), reasoning=m.get("reasoning_content", ""),
                                tool_calls=calls, name=m.get("name", "")))
        d["finish_reason"] = FinishReason(d["finish_reason"])
        if d.get("routed_experts") is not None:
            d["routed_experts"] = tensor_from_json(d["routed_experts"])
        names = {f.name for f in dataclasses.fields(Trajectory)}
        out.append(Trajectory(messages=msgs, **{k: v for k, v in d.items() if k in names}))
    return out


def _end_ids(tok, generated: bool = False) -> frozenset[int]:
    """Ids that end a message: ``im_end_id``; with harmony (model/harmony.py) also <|call|> and, in a
    rendering (not ``generated``), <|end|> (a sampled turn ends only at a stop: <|return|> or <|call|>)."""
    extra = (tok.think_end_id,) if tok.harmony and not generated else ()
    return frozenset((tok.im_end_id, *tok.turn_stop_ids, *extra))
