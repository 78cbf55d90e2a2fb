"""The layer rules of docs/architecture.md ("Layout and imports"), enforced by a scan of every
module's syntax tree; the scanner's own tests plant small packages in ``tmp_path`` and show each
check failing.

What the scan reads, in every module of the packages pyproject lists (``jointrl``, ``jointrl.rl``,
…; package data such as the sandboxes' tool scripts is not a module of ours):

- every ``import`` / ``from … import`` statement anywhere in the file: module level, class body,
  function body, ``if TYPE_CHECKING:``; absolute or relative; resolved to the most specific module
  of ours it names (``from jointrl.rl import learner`` → ``jointrl.rl.learner``; ``from
  jointrl.rl.learner.batch import TrainBatch`` → ``jointrl.rl.learner.batch``);
- every string constant that spells one of our modules (``"jointrl.envs.cad.domain"`` or
  ``"module:function"``): what ``importlib.import_module`` is handed (``envs/registry.py``).

Importing a module also runs its parent packages' ``__init__``; those implicit edges are not in the
graph (each module would otherwise import every ancestor, and a package ``__init__`` that re-exports
its submodules would close a cycle with each of them); an explicit import of a package is.

The checks:

- **layers**: no import breaks ``RULES``;
- **cycles**, at three grains: modules; *units*, where a subpackage below a top-level folder
  (``rl/learner/``, ``rl/rollout/``, ``envs/cad/``, …) is one node beside its sibling modules
  (``rl/learner/worker.py`` → ``rl/export.py`` → ``rl/learner/value_head.py`` is a cycle); and the
  top-level folders. In-function imports count: an import moved into a function to dodge a cycle
  at import time still ties the two modules together (neither can be read, tested or changed
  alone), so the cycle is broken by moving code, not by hiding the import;
- **in-function imports** of our modules are kept only for an optional heavy dependency or a
  deliberate lazy load, and say which on the line or the line above (a comment).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
import tomllib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOP = "jointrl"


@dataclass(frozen=True, slots=True)
class Rule:
    """Modules in ``layer`` (dotted, below the top package: ``"rl.rollout"``; a top-level module
    such as ``"messages"`` is a layer of its own) import none of ``forbids``, or, when ``only`` is
    given, nothing of ours outside ``layer`` and ``only``."""

    layer: str
    forbids: tuple[str, ...] = ()
    only: tuple[str, ...] | None = None
    why: str = ""

    def breaks(self, target: str) -> bool:
        if _under(target, self.layer):
            return False
        if self.only is not None:
            return not any(_under(target, p) for p in self.only)
        return any(_under(target, p) for p in self.forbids)


# docs/architecture.md, "Layout and imports", states these; keep the two the same.
RULES: tuple[Rule, ...] = (
    Rule("messages", only=(), why="the shared chat records are a leaf: they import nothing of ours"),
    Rule("kernels", only=(), why="kernels import nothing of ours"),
    Rule("model", forbids=("rl", "envs", "rewards"), why="the model imports no trainer, env or reward"),
    Rule("envs", forbids=("model", "rl"), why="envs import no model or trainer"),
    Rule("rewards", forbids=("model", "rl"), why="rewards import no model or trainer"),
    Rule("rl.rollout", forbids=("rl.learner",), why="the rollout side never imports the learner"),
)

# Cycles another branch of issue 30 breaks, as (importer, target) edges left out of the check; the
# lead deletes each entry when that branch is merged, and the test then holds without it.
PENDING_CYCLE_EDGES: dict[tuple[str, str], str] = {}

# Modules whose in-function imports are not yet commented or moved (empty: every one says why).
PENDING_IN_FUNCTION: dict[str, str] = {}


@dataclass(frozen=True, slots=True)
class Import:
    importer: str  # dotted module name
    target: str  # the most specific module of ours the statement names
    line: int
    in_function: bool
    commented: bool  # a comment on the line or the line above


def _under(module: str, prefix: str) -> bool:
    """``module`` is ``prefix`` or inside it (both dotted, below the top package)."""
    return module == prefix or module.startswith(prefix + ".")


def _below_top(module: str, top: str) -> str:
    return "" if module == top else module.removeprefix(top + ".")


def pyproject_packages(root: Path = ROOT) -> list[str]:
    return tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]


def package_modules(root: Path, packages: Iterable[str], top: str = TOP) -> dict[str, Path]:
    """Every module of ``packages`` (dotted names; package ``top`` is the folder ``root``): name → file."""
    out: dict[str, Path] = {}
    for pkg in packages:
        folder = root.joinpath(*pkg.split(".")[1:])
        for f in sorted(folder.glob("*.py")):
            out[pkg if f.stem == "__init__" else f"{pkg}.{f.stem}"] = f
    return out


_MODULE_STRING = re.compile(r"[A-Za-z_]\w*(\.\w+)+(:\w+)?")  # "jointrl.envs.cad.domain", "…:load_policy"


def module_imports(name: str, path: Path, known: set[str], top: str = TOP) -> list[Import]:
    """The imports of our modules (``known``) that module ``name``, file ``path``, makes."""
    source = path.read_text()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT]
    comments = {t.start[0] for t in tokens}
    own_line = {t.start[0] for t in tokens if t.line.lstrip().startswith("#")}  # a comment line of its own

    def commented(node: ast.AST) -> bool:
        return node.lineno - 1 in own_line or any(n in comments for n in range(node.lineno, node.end_lineno + 1))

    def resolve(base: str, names: Sequence[str]) -> list[str]:
        if not _under(base, top):
            return []
        subs = [f"{base}.{n}" for n in names if f"{base}.{n}" in known]
        return subs + ([base] if len(subs) < len(names) or not names else [])

    def absolute(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        parts = package.split(".")
        if node.level > len(parts):
            raise ValueError(f"{name}:{node.lineno}: relative import beyond the top package")
        return ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))

    found: list[Import] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            targets: list[str] = []
            if isinstance(child, ast.Import):
                targets = [t for alias in child.names for t in resolve(alias.name, [])]
            elif isinstance(child, ast.ImportFrom):
                targets = resolve(absolute(child), [alias.name for alias in child.names])
            elif isinstance(child, ast.Constant) and isinstance(child.value, str) and _MODULE_STRING.fullmatch(child.value):
                targets = [m for m in (child.value.partition(":")[0],) if m in known]
            found.extend(Import(name, t, child.lineno, in_function, commented(child)) for t in targets)
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(source, filename=str(path)), False)
    return found


def scan(root: Path, packages: Iterable[str], top: str = TOP) -> list[Import]:
    """Every import of ours that a module of ``packages`` makes."""
    modules = package_modules(root, packages, top)
    return [imp for name, path in modules.items() for imp in module_imports(name, path, set(modules), top)]


def layer_violations(imports: Iterable[Import], rules: Sequence[Rule] = RULES, top: str = TOP) -> list[str]:
    """One line per (import, rule it breaks)."""
    out = []
    for imp in imports:
        src, dst = _below_top(imp.importer, top), _below_top(imp.target, top)
        for rule in rules:
            if _under(src, rule.layer) and rule.breaks(dst):
                where = "in a function" if imp.in_function else "at module level"
                out.append(f"{imp.importer}:{imp.line} imports {imp.target} {where}: {rule.why}")
    return out


def unit(module: str) -> str:
    """A subpackage below a top-level folder is one unit (``jointrl.rl.learner.worker`` →
    ``jointrl.rl.learner``); a module directly in a top-level folder is its own."""
    return ".".join(module.split(".")[:3]) if module.count(".") >= 3 else module


def folder(module: str) -> str:
    """The top-level folder (``jointrl.rl``), or the module itself when it sits at the top."""
    return ".".join(module.split(".")[:2])


def cycles(imports: Iterable[Import], node: Callable[[str], str] = lambda m: m,
           ignore: Iterable[tuple[str, str]] = ()) -> list[list[str]]:
    """The cycles of the graph whose nodes are ``node(module)``, leaving out the ``ignore``d edges:
    one closed path ``[a, b, …, a]`` per strongly connected component of two or more nodes."""
    skip = set(ignore)
    graph: dict[str, set[str]] = {}
    for imp in imports:
        a, b = node(imp.importer), node(imp.target)
        graph.setdefault(a, set())
        graph.setdefault(b, set())
        if a != b and (a, b) not in skip:
            graph[a].add(b)

    def reach(start: str, edges: dict[str, set[str]]) -> set[str]:
        seen, todo = {start}, [start]
        while todo:
            for w in edges[todo.pop()] - seen:
                seen.add(w)
                todo.append(w)
        return seen

    reverse: dict[str, set[str]] = {v: set() for v in graph}
    for v, ws in graph.items():
        for w in ws:
            reverse[w].add(v)
    out, done = [], set()
    for v in sorted(graph):
        if v in done:
            continue
        component = reach(v, graph) & reach(v, reverse)  # v's strongly connected component
        done |= component
        if len(component) < 2:
            continue
        prev: dict[str, str] = {}  # breadth-first from v back to v inside the component
        frontier = [v]
        while v not in prev:
            nxt = []
            for u in frontier:
                for w in sorted(graph[u] & component):
                    if w not in prev:
                        prev[w] = u
                        nxt.append(w)
            frontier = nxt
        path = [v]
        while len(path) == 1 or path[-1] != v:
            path.append(prev[path[-1]])
        out.append(path[::-1])
    return out


def uncommented_in_function(imports: Iterable[Import], pending: Iterable[str] = ()) -> list[str]:
    skip = set(pending)
    return [f"{imp.importer}:{imp.line} imports {imp.target} in a function without a comment saying why "
            "(an optional heavy dependency, a deliberate lazy load); otherwise import it at module level"
            for imp in imports if imp.in_function and not imp.commented and imp.importer not in skip]


@pytest.fixture(scope="module")
def repo_imports() -> list[Import]:
    return scan(ROOT, pyproject_packages())


def test_no_import_breaks_the_layer_rules(repo_imports):
    assert len(repo_imports) > 400  # the scan reads the package, not an empty folder
    assert layer_violations(repo_imports) == []


def test_no_import_cycles(repo_imports):
    assert cycles(repo_imports) == []
    assert cycles(repo_imports, unit, PENDING_CYCLE_EDGES) == []
    assert cycles(repo_imports, folder) == []


def test_in_function_imports_say_why(repo_imports):
    assert uncommented_in_function(repo_imports, PENDING_IN_FUNCTION) == []


def test_the_allow_lists_hold_nothing_stale(repo_imports):
    """An entry whose module no longer has an uncommented in-function import, or whose edge is gone,
    fails here: the lists only shrink, and the lead deletes each entry as its branch lands."""
    assert {imp.importer for imp in repo_imports if imp.in_function and not imp.commented} >= set(PENDING_IN_FUNCTION)
    assert {(unit(imp.importer), unit(imp.target)) for imp in repo_imports} >= set(PENDING_CYCLE_EDGES)


# --- the scanner on planted packages ------------------------------------------------------------

PLANTED = ("pkg", "pkg.model", "pkg.kernels", "pkg.envs", "pkg.rewards", "pkg.rl", "pkg.rl.rollout", "pkg.rl.learner")


def plant(root: Path, files: dict[str, str]) -> Path:
    """A package ``pkg`` at ``root`` with every folder of ``PLANTED`` and ``files`` (path → source)."""
    for pkg in PLANTED:
        root.joinpath(*pkg.split(".")[1:], "__init__.py").parent.mkdir(parents=True, exist_ok=True)
        root.joinpath(*pkg.split(".")[1:], "__init__.py").touch()
    for rel, src in files.items():
        (root / rel).write_text(src)
    return root


CLEAN = {
    "messages.py": "import json\n",
    "kernels/ops.py": "import torch\nfrom . import other\n",
    "kernels/other.py": "",
    "model/net.py": "from pkg.kernels import ops\nfrom pkg.messages import json\nfrom ..kernels.ops import torch\n",
    "envs/base.py": "from pkg.messages import json\n",
    "rewards/base.py": "from pkg.envs.base import json\n",
    "rl/rollout/engine.py": "from pkg.model import net\nfrom pkg.rl import types\n",
    "rl/types.py": "from pkg.envs import base\n",
    "rl/learner/step.py": "from pkg.rl.rollout.engine import x\nfrom pkg.model.net import y\n",
    "rl/train.py": ("from pkg.rl.learner import step\n\n"
                    "def main():\n    from pkg.rl.rollout import engine  # lazy: the engine pulls in CUDA\n"),
}


def planted_scan(tmp_path: Path, changes: dict[str, str]) -> list[Import]:
    return scan(plant(tmp_path, CLEAN | changes), PLANTED, top="pkg")


def test_a_clean_planted_package_passes(tmp_path):
    imports = planted_scan(tmp_path, {})
    assert ("pkg.model.net", "pkg.kernels.ops") in {(i.importer, i.target) for i in imports}  # relative, resolved
    assert ("pkg.rl.train", "pkg.rl.rollout.engine") in {(i.importer, i.target) for i in imports}
    assert layer_violations(imports, top="pkg") == []
    assert cycles(imports) == cycles(imports, unit) == cycles(imports, folder) == []
    assert uncommented_in_function(imports) == []


@pytest.mark.parametrize("path, source, importer, target", [
    # model reaches into envs, in a function, relative: the chat template's old import
    ("model/template.py", "def render():\n    from ..envs.base import Message\n", "pkg.model.template", "pkg.envs.base"),
    ("model/template.py", "from pkg import rl\n", "pkg.model.template", "pkg.rl"),
    ("model/template.py", "import pkg.rewards.base as rb\n", "pkg.model.template", "pkg.rewards.base"),
    ("kernels/ops.py", "from pkg.model.net import Net\n", "pkg.kernels.ops", "pkg.model.net"),
    ("kernels/ops.py", "from pkg.messages import json\n", "pkg.kernels.ops", "pkg.messages"),
    ("messages.py", "from pkg.envs import base\n", "pkg.messages", "pkg.envs.base"),
    ("envs/base.py", "from pkg.model import net\n", "pkg.envs.base", "pkg.model.net"),
    ("rewards/base.py", "if True:\n    from ..rl import types\n", "pkg.rewards.base", "pkg.rl.types"),
    # the sampler's old position_ids import, and the same through a module-name string
    ("rl/rollout/sampler.py", "from pkg.rl.learner.step import position_ids\n", "pkg.rl.rollout.sampler",
     "pkg.rl.learner.step"),
    ("rl/rollout/sampler.py", "STEP = 'pkg.rl.learner.step:main'\n", "pkg.rl.rollout.sampler", "pkg.rl.learner.step"),
])
def test_a_planted_wrong_way_import_fails(tmp_path, path, source, importer, target):
    found = layer_violations(planted_scan(tmp_path, {path: source}), top="pkg")
    assert len(found) == 1 and found[0].startswith(f"{importer}:") and f" imports {target} " in found[0], found


def test_a_planted_module_cycle_fails_even_through_a_function(tmp_path):
    imports = planted_scan(tmp_path, {
        "rl/learner/forward.py": "from pkg.rl.learner.prefix import run\n",
        "rl/learner/prefix.py": "def run():\n    from pkg.rl.learner.forward import layers  # hides the cycle\n",
    })
    assert cycles(imports) == [["pkg.rl.learner.forward", "pkg.rl.learner.prefix", "pkg.rl.learner.forward"]]
    edge = ("pkg.rl.learner.prefix", "pkg.rl.learner.forward")
    assert cycles(imports, ignore=[edge]) == []


def test_a_planted_cycle_through_a_subpackage_fails(tmp_path):
    """worker → export → value_head: no module imports itself back, but rl/learner/ and rl/export.py
    import each other."""
    imports = planted_scan(tmp_path, {
        "rl/learner/worker.py": "def load():\n    from pkg.rl.export import load_checkpoint\n",
        "rl/export.py": "from pkg.rl.learner.value_head import PREFIX\n",
        "rl/learner/value_head.py": "PREFIX = 'v_head.'\n",
    })
    assert cycles(imports) == []
    assert cycles(imports, unit) == [["pkg.rl.export", "pkg.rl.learner", "pkg.rl.export"]]
    assert cycles(imports, unit, [("pkg.rl.learner", "pkg.rl.export")]) == []


def test_a_planted_folder_cycle_fails(tmp_path):
    imports = planted_scan(tmp_path, {"envs/base.py": "from pkg.rewards import base\n"})
    assert cycles(imports, folder) == [["pkg.envs", "pkg.rewards", "pkg.envs"]]


def test_an_uncommented_in_function_import_fails(tmp_path):
    imports = planted_scan(tmp_path, {
        "rl/train.py": "def main():\n    from pkg.rl.rollout import engine\n\n"
                       "def lazy():\n    # the learner imports deepspeed\n    from pkg.rl.learner import step\n",
    })
    assert uncommented_in_function(imports) == [
        "pkg.rl.train:2 imports pkg.rl.rollout.engine in a function without a comment saying why (an optional heavy "
        "dependency, a deliberate lazy load); otherwise import it at module level"]
    assert uncommented_in_function(imports, ["pkg.rl.train"]) == []
