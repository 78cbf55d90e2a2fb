"""The harmony chat format (OpenAI gpt-oss) in token space: rendering, written to the published format
(github.com/openai/harmony: docs/format.md and the reference encoder's `src/encoding.rs`), with
``ChatTemplate``'s interface (``tok``, ``image_tokens``, ``render``, ``continuation``,
``generation_prompt``, ``assistant_turn``) so the agent loop takes it like the others.

One message is ``<|start|>{header}<|message|>{content}{end}``; special tokens (by id, never from
text) are <|start|>, <|message|>, <|channel|>, <|constrain|>, <|end|>, <|return|> (a final answer's
end as sampled: the engine's stop, ``tok.im_end_id``) and <|call|> (a tool call's end, also a stop).
Our messages map to harmony's as follows (T(x): x as plain text):

    system block   <|start|>system<|message|>T(model identity, dates, "Reasoning: {effort}",
                   "# Valid channels: analysis, commentary, final. ..." [+ the functions line with tools])<|end|>
    system msg     <|start|>developer<|message|>T("# Instructions\\n\\n{content}" [+ "\\n\\n# Tools ..."])<|end|>
    user           <|start|>user<|message|>T(content)<|end|>
    assistant      <|start|>assistant<|channel|>analysis<|message|>T(reasoning)<|end|>   (unless dropped)
                   then, without calls:  <|start|>assistant<|channel|>final<|message|>T(content)<|end|>
                   with calls: the content (if any) as a commentary preamble
                       <|start|>assistant<|channel|>commentary<|message|>T(content)<|end|>
                   and per call <|start|>assistant<|channel|>commentary to=functions.{name}
                       <|constrain|>json<|message|>T(compact JSON arguments)<|call|>
    tool           <|start|>functions.{name} to=assistant<|channel|>commentary<|message|>T(content)<|end|>
                   (a result without a name takes its call's: the k-th result answers the k-th call)
    generation     <|start|>assistant<|channel|>analysis<|message|>

Tools are the developer message's TypeScript-like `namespace functions` (harmony's
``json_schema_to_typescript``; `oneOf` schemas are refused).

The generation prompt opens the analysis channel (gpt-oss reasons first on every turn), so the
thinking budget (rl/rollout/turn.generate_turn) is the analysis message: ``tok.think_id`` is
<|message|>, ``tok.think_end_id`` is <|end|>, which the budget forces (masked) when it runs out;
the model then writes its next header itself (<|start|>assistant...). An assistant message always
renders its analysis message (empty when it has no reasoning), so a turn's canonical tokens follow
the generation prompt.

Prefix property: after a tool-call turn (ends <|call|>) ``render(history + [turn] + results) ==
render(history) + generated + continuation(results)`` exactly (tested). Harmony's published rule
(``auto_drop_analysis``) drops, once the last assistant message is a final answer, the analysis
messages before the first final one, and a history shows a sampled <|return|> as <|end|>; where a
conversation continues after a final answer the loop keeps **the generated tokens as they were**
(its history holds the analysis and <|return|>), the rule Qwen3's template has for its dropped
reasoning (model/hf_chat_template.py); ``drops_reasoning`` is True.
"""

from __future__ import annotations

import json
from typing import Any

from jointrl.messages import Message, ToolSpec

# Token attribute → harmony token string (model/hf_tokenizer.HFTokenizer reads them; its roles below).
HARMONY_TOKENS: dict[str, str] = {
    "start_id": "<|start|>", "end_id": "<|end|>", "message_id": "<|message|>", "channel_id": "<|channel|>",
    "return_id": "<|return|>", "call_id": "<|call|>", "constrain_id": "<|constrain|>",
}
# The loop's roles (model/tokenizer.Tokenizer) played by harmony's tokens (module docstring).
HARMONY_ROLES: dict[str, str] = {
    "eos_id": "<|endoftext|>", "im_start_id": "<|start|>", "im_end_id": "<|return|>", "think_id": "<|message|>",
    "think_end_id": "<|end|>", "tool_call_id": "<|constrain|>", "tool_call_end_id": "<|call|>",
}
IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
CHANNELS = "# Valid channels: analysis, commentary, final. Channel must be included for every message."
FUNCTIONS_LINE = "Calls to these tools must go to the commentary channel: 'functions'."


class HarmonyTemplate:
    """Harmony rendering over ``tok`` (an ``HFTokenizer`` with harmony's tokens). The system block's
    fields are constructor arguments (None leaves a line out)."""

    drops_reasoning = True  # module docstring: the rule after a final answer

    def __init__(self, tokenizer: Any, image_tokens: int = 0, *, model_identity: str | None = IDENTITY,
                 knowledge_cutoff: str | None = "2024-06", current_date: str | None = None,
                 reasoning_effort: str | None = "medium") -> None:
        if image_tokens:
            raise ValueError(f"HarmonyTemplate: image_tokens={image_tokens}; harmony has no image slots here")
        if reasoning_effort not in (None, "low", "medium", "high"):
            raise ValueError(f"HarmonyTemplate: reasoning_effort must be low, medium or high, got {reasoning_effort!r}")
        self.tok, self.image_tokens = tokenizer, 0
        self.identity, self.cutoff, self.date, self.effort = model_identity, knowledge_cutoff, current_date, reasoning_effort
        self.ids = {k: tokenizer.special_ids[v] for k, v in HARMONY_TOKENS.items()}

    # -- pieces: a list of special-token names and plain strings, encoded run by run -----------------
    def _encode(self, pieces: list[str | int]) -> list[int]:
        """Ints are special ids; each maximal run of strings is encoded as one plain text."""
        ids: list[int] = []
        run: list[str] = []
        for p in [*pieces, -1]:
            if isinstance(p, str):
                run.append(p)
                continue
            if run:
                ids += self.tok.encode("".join(run))
                run = []
            if p >= 0:
                ids.append(p)
        return ids

    def _message(self, header: list[str | int], content: str, end: str = "end_id") -> list[str | int]:
        s = self.ids
        return [s["start_id"], *header, s["message_id"], content, s[end]]

    def _system(self, has_tools: bool) -> list[str | int]:
        top = "\n".join(x for x in (self.identity, self.cutoff and f"Knowledge cutoff: {self.cutoff}",
                                    self.date and f"Current date: {self.date}") if x)
        sections = [x for x in (top, self.effort and f"Reasoning: {self.effort}") if x]
        sections.append(CHANNELS + (f"\n{FUNCTIONS_LINE}" if has_tools else ""))
        return self._message(["system"], "\n\n".join(sections))

    def _assistant(self, m: Message, analysis: bool = True) -> list[str | int]:
        s = self.ids
        out = self._message(["assistant", s["channel_id"], "analysis"], m.reasoning) if analysis else []
        if not m.tool_calls:
            return out + self._message(["assistant", s["channel_id"], "final"], m.content)
        if m.content:
            out += self._message(["assistant", s["channel_id"], "commentary"], m.content)
        for c in m.tool_calls:
            args = json.dumps(c.arguments, ensure_ascii=False, separators=(",", ":"))
            out += self._message(["assistant", s["channel_id"], f"commentary to=functions.{c.name} ",
                                  s["constrain_id"], "json"], args, "call_id")
        return out

    def _pieces(self, m: Message, first: bool, drop: bool = False) -> list[str | int]:
        s = self.ids
        if m.role == "system":
            if not first:
                raise ValueError("harmony: a system message must come first (it becomes the developer message)")
            return []  # rendered by render() with the tools
        if m.role == "user":
            return self._message(["user"], m.content)
        if m.role == "assistant":
            return self._assistant(m, analysis=not drop)
        if m.role == "tool":
            return self._message([f"functions.{m.name} to=assistant", s["channel_id"], "commentary"], m.content)
        raise ValueError(f"message role must be one of system/user/assistant/tool, got {m.role!r}")

    # -- the template interface --------------------------------------------------------------------
    def render(self, messages: list[Message], tools: list[ToolSpec] = (), add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a whole conversation in harmony (with its analysis-dropping rule)."""
        messages, tools = list(messages), list(tools)
        pieces = self._system(bool(tools))
        instructions = messages[0].content if messages and messages[0].role == "system" else None
        sections = ([f"# Instructions\n\n{instructions}"] if instructions is not None else []) + \
                   ([tools_section(tools)] if tools else [])
        if sections:
            pieces += self._message(["developer"], "\n\n".join(sections))
        drop = _dropped_reasoning(messages)
        for i, m in enumerate(_named_results(messages)):
            pieces += self._pieces(m, i == 0, i in drop)
        if add_generation_prompt:
            pieces += self._generation()
        return self._encode(pieces)

    def _generation(self) -> list[str | int]:
        s = self.ids
        return [s["start_id"], "assistant", s["channel_id"], "analysis", s["message_id"]]

    def generation_prompt(self) -> list[int]:
        """``<|start|>assistant<|channel|>analysis<|message|>``."""
        return self._encode(self._generation())

    def assistant_turn(self, m: Message, calls_before: int = 0) -> list[int]:
        """The ids a model writes for ``m`` after the generation prompt, through its stop (<|call|> or
        <|return|>; a final answer as sampled ends <|return|>, not a history's <|end|>). ``calls_before``
        is ``HFChatTemplate``'s (Kimi's call ids); harmony writes no call ids and ignores it."""
        ids = self._encode(self._assistant(m))
        prompt = self.generation_prompt()
        assert ids[:len(prompt)] == prompt, "an assistant message starts with its analysis message"
        ids = ids[len(prompt):]
        if not m.tool_calls:
            ids[-1] = self.ids["return_id"]
        return ids

    def continuation(self, messages: list[Message], add_generation_prompt: bool = True) -> list[int]:
        """Ids that follow a generated turn's stop token: the messages, then the generation prompt."""
        pieces: list[str | int] = []
        for m in messages:
            pieces += self._pieces(m, False)
        if add_generation_prompt:
            pieces += self._generation()
        return self._encode(pieces)


def _named_results(messages: list[Message]) -> list[Message]:
    """Tool messages without a name (OpenAI / Anthropic clients send ids, not names) take the name of the
    call they answer: the k-th result after an assistant message answers its k-th call."""
    out, calls = [], []
    for m in messages:
        if m.role == "assistant":
            calls = [c.name for c in m.tool_calls]
        elif m.role == "tool" and not m.name and calls:
            m = Message(role="tool", content=m.content, name=calls.pop(0), image=m.image)
        elif m.role == "tool" and calls:
            calls.pop(0)
        out.append(m)
    return out


def _dropped_reasoning(messages: list[Message]) -> set[int]:
    """Indices of assistant messages whose analysis harmony drops: when the last assistant message is a
    final answer (no calls), those up to and including the first final answer (its analysis comes
    before it)."""
    assistants = [i for i, m in enumerate(messages) if m.role == "assistant"]
    if not assistants or messages[assistants[-1]].tool_calls:
        return set()
    first_final = next(i for i in assistants if not messages[i].tool_calls)
    return {i for i in assistants if i <= first_final}


def tools_section(tools: list[ToolSpec]) -> str:
    """Harmony's ``# Tools`` section for the ``functions`` namespace."""
    lines = ["## functions\n", "namespace functions {\n"]
    for t in tools:
        lines += [f"// {line}" for line in t.description.splitlines()]
        params = t.parameters or {}
        if params.get("properties"):
            lines.append(f"type {t.name} = (_: {schema_to_typescript(params, '')}) => any;\n")
        else:
            lines.append(f"type {t.name} = () => any;\n")
    lines.append("} // namespace functions")
    return "# Tools\n\n" + "\n".join(lines)


def _default(value: Any, enum: bool) -> str:
    if isinstance(value, str):
        return f"default: {value}" if enum else f'default: "{value}"'
    return f"default: {json.dumps(value, separators=(',', ':'))}"


def schema_to_typescript(schema: dict[str, Any], indent: str) -> str:
    """A JSON schema as harmony's TypeScript-like type (its ``json_schema_to_typescript``, without `oneOf`)."""
    if "oneOf" in schema:
        raise ValueError("harmony tool schema: oneOf is not supported by jointrl's renderer")
    kind = schema.get("type")
    if isinstance(kind, list):
        return " | ".join("number" if k == "integer" else k for k in kind)
    if kind == "object":
        out = f"{indent}// {schema['description']}\n" if "description" in schema else ""
        out += "{\n"
        required = set(schema.get("required", []))
        for key, val in schema.get("properties", {}).items():
            if "title" in val:
                out += f"{indent}// {val['title']}\n{indent}//\n"
            if "oneOf" in val:
                raise ValueError(f"harmony tool schema: oneOf (property {key!r}) is not supported by jointrl's renderer")
            if "description" in val:
                out += f"{indent}// {val['description']}\n"
            if val.get("examples"):
                out += f"{indent}// Examples:\n" + "".join(f'{indent}// - "{e}"\n' for e in val["examples"] if isinstance(e, str))
            ts = schema_to_typescript(val, indent + "    ")
            if val.get("nullable") and "null" not in ts:
                ts += " | null"
            out += f"{indent}{key}{'' if key in required else '?'}: {ts},"
            if "default" in val:
                out += f" // {_default(val['default'], bool(val.get('enum')))}"
            out += "\n"
        return out + f"{indent}}}"
    if kind == "string":
        enum = [f'"{v}"' for v in schema.get("enum", []) if isinstance(v, str)]
        return " | ".join(enum) if enum else "string"
    if kind in ("number", "integer"):
        return "number"
    if kind == "boolean":
        return "boolean"
    if kind == "array":
        return f"{schema_to_typescript(schema['items'], indent)}[]" if "items" in schema else "Array<any>"
    return "any"
