"""The browser domain's ``Env``: local sites and a browser in the episode's sandbox.

``reset(task)`` starts a fresh bwrap sandbox running the page driver (``web/driver.py``): the
task's sites (wiki, shop, settings; generated from ``task.metadata["seed"]``) on loopback
ports of the sandbox's own network namespace, and a browser -- text mode (markdown with
numbered elements) or image mode (Chromium screenshots plus the element list; the observation
carries the PNG in ``Observation.image``). Tools: ``goto``, ``click``, ``type``, ``press``,
``scroll``, ``back``, ``find`` and ``answer`` (ends the episode; its text is the final answer).

Errors: a malformed call or an impossible action (no such element, unknown key, unreachable
URL) is an error observation and the episode goes on; a driver that dies or hangs raises
``EnvError``. The sites' app state (cart, saved forms) is ``/work/site/state.json``;
``verify_sandbox`` opens a fresh sandbox over a copy of ``/work`` for the ``app_state`` reward.
"""

from __future__ import annotations

import asyncio
import base64
import secrets
import shutil

from jointrl.envs.base import EnvError, Message, Observation, Task, ToolCall, ToolSpec, refuse, validate_call
from jointrl.envs.browser.compact import compact_view
from jointrl.envs.browser.driver_process import DriverProcess
from jointrl.envs.browser.web.sites import PORTS, base_url
from jointrl.envs.browser.web.text_browser import KEYS, SCROLLS
from jointrl.envs.sandbox.base import SandboxConfig
from jointrl.envs.sandbox.bwrap import BwrapSandbox, sandbox_root

MODES = ("text", "image")


def _tool(name: str, description: str, **props: dict) -> ToolSpec:
    return ToolSpec(name, description, {"type": "object", "properties": props, "required": list(props),
                                        "additionalProperties": False})


TOOLS = [
    _tool("goto", "Open a URL (absolute, or relative to the current page).", url={"type": "string"}),
    _tool("click", "Click the element with this number: follow a link, press a button, toggle a checkbox.",
          id={"type": "integer"}),
    _tool("type", "Set the text of a text field, or choose an option of a select (by its label).",
          id={"type": "integer"}, text={"type": "string"}),
    _tool("press", f"Press a key: one of {list(KEYS)} (Enter submits the focused field's form).",
          key={"type": "string", "enum": list(KEYS)}),
    _tool("scroll", "Scroll the page.", direction={"type": "string", "enum": list(SCROLLS)}),
    _tool("back", "Go back to the previous page."),
    _tool("find", "Find a text on the current page; lists the matching lines and scrolls to the first.",
          text={"type": "string"}),
    _tool("answer", "Give your final answer (or 'done' for a task that only asks you to change something). "
          "Ends the episode.", text={"type": "string"}),
]


# ``envs.prompt=compact``: the same tools and schemas with a few words each, and a short system
# prompt, for a byte-level model whose every training and rollout token re-reads the system turn.
COMPACT = {"goto": "Open a URL.", "click": "Click element N.", "type": "Fill field N (or pick a select option).",
           "press": "Press a key.", "scroll": "Scroll.", "back": "Go back.", "find": "Find text on the page.",
           "answer": "Final answer ('done' for a change). Ends the episode."}
TOOLS_COMPACT = [ToolSpec(t.name, COMPACT[t.name], t.parameters) for t in TOOLS]


def system_prompt(mode: str, compact: bool = False) -> str:
    sites = ", ".join(f"{name} at {base_url(name)}/" for name in PORTS)
    if compact:
        return f"Sites: {sites}. Use the [N] numbers with click and type. Call answer when done."
    view = ("Each observation is the page as markdown; links, buttons and form fields carry numbers, "
            "e.g. [3] Paris or [7: text \"q\" = \"\"]." if mode == "text" else
            "Each observation is a screenshot of the page plus a list of its numbered links, buttons and fields.")
    return (f"You are a web-browsing agent. The sites you can use: {sites}. {view} "
            "Use the numbers with click and type. When you know the answer, or have finished the task, "
            "call answer.")


class BrowserEnv:
    """``Env`` for browser tasks; ``mode`` is ``"text"`` or ``"image"`` (a task's
    ``metadata["mode"]`` overrides it); ``config`` sets the sandbox limits."""

    def __init__(self, config: SandboxConfig | None = None, mode: str = "text", action_timeout_s: float = 60.0,
                 compact: bool = False, compact_views: bool | None = None) -> None:
        """``compact``: the short system prompt and tool descriptions (``envs.prompt=compact``), and in
        text mode compact observations (``compact.py``: a same-page update as its changed lines);
        ``compact_views`` (default: ``compact``) sets the latter alone."""
        if mode not in MODES:
            raise ValueError(f"browser mode must be one of {MODES}, got {mode!r}")
        self.config, self.mode, self.action_timeout_s = config or default_config(mode), mode, action_timeout_s
        self.compact = compact
        self.compact_views = compact if compact_views is None else compact_views
        self.tools: list[ToolSpec] = list(TOOLS_COMPACT if compact else TOOLS)
        self.driver: DriverProcess | None = None
        self.task: Task | None = None
        self.done = False
        self.num_tool_errors = 0
        self._text_mode = mode == "text"
        self._last_view: str | None = None  # the previous full text view (compact mode's reference)

    async def reset(self, task: Task) -> list[Message]:
        await self.close()
        mode = task.metadata.get("mode", self.mode)
        if mode not in MODES:
            raise ValueError(f"task {task.id!r}: metadata mode must be one of {MODES}, got {mode!r}")
        seed = task.metadata.get("seed")
        if not isinstance(seed, int):
            raise ValueError(f"browser task {task.id!r} needs an integer metadata['seed'], got {seed!r}")
        config = self.config if mode == self.mode else default_config(mode)
        self.driver = await asyncio.to_thread(DriverProcess, config, seed, mode)
        self.task, self.done, self.num_tool_errors = task, False, 0
        self._text_mode, self._last_view = mode == "text", None
        return [Message(role="system", content=system_prompt(mode, self.compact)), Message(role="user", content=task.prompt)]

    async def step(self, call: ToolCall) -> Observation:
        if self.driver is None:
            raise RuntimeError("BrowserEnv.step() called before reset()")
        problem = validate_call(call, self.tools)
        if (refused := refuse(self, problem, "answer")) is not None:
            return refused
        if call.name == "answer":
            self.done = True
            return Observation(call.arguments["text"], done=True)
        reply = await asyncio.to_thread(self.driver.request, call.name, call.arguments, self.action_timeout_s)
        image = base64.b64decode(reply["image"]) if reply.get("image") else None
        if not reply["ok"]:
            self.num_tool_errors += 1
            return Observation(reply["text"], is_error=True, image=image)
        text = reply["text"]
        if self.compact_views and self._text_mode:
            text, self._last_view = compact_view(self._last_view, text), text
        return Observation(text, image=image)

    def verify_sandbox(self) -> BwrapSandbox:
        """A fresh sandbox over a copy of ``/work`` as it is now (the sites' state file); the caller closes it."""
        if self.driver is None:
            raise RuntimeError("BrowserEnv.verify_sandbox() called before reset() or after close()")
        snapshot = sandbox_root() / f"snap-{secrets.token_hex(8)}"
        try:
            self.driver.sandbox.copy_workdir_to(snapshot)
            return BwrapSandbox(self.config, workdir_from=snapshot, shell=False)
        except OSError as err:
            raise EnvError(f"cannot snapshot the browser episode's state: {err}") from err
        finally:
            shutil.rmtree(snapshot, ignore_errors=True)

    async def close(self) -> None:
        if self.driver is not None:
            driver, self.driver = self.driver, None
            await asyncio.to_thread(driver.close)


def default_config(mode: str) -> SandboxConfig:
    """Text mode: the sandbox defaults. Image mode: Chromium's many processes and threads count
    against the pids limit, and it needs more CPU time than a shell command."""
    if mode == "image":
        return SandboxConfig(timeout_s=60.0, max_processes=1024, cpu_seconds=1200, max_memory_bytes=3 << 30)
    return SandboxConfig(timeout_s=30.0)
