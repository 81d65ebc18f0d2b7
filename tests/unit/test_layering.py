"""The layout's walls, read from the source: layers import downward only, core's floors
too, no package holds an import cycle, llama.cpp is called from ``core/llama/`` alone, and
the gateway meets the session layer through its face.  Every import counts, those under
``TYPE_CHECKING`` and inside functions included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("core", "sessions", "gateway", "cli")
LAYERS = {"core": 0, "sessions": 1, "gateway": 2, "cli": 3}

# Core, bottom to top.  A module imports its own floor or lower ones, never a higher one.
CORE_FLOORS: tuple[tuple[str, ...], ...] = (
    # shared types: errors, settings, prompts, spans, constraints, policies, results
    ("core.errors", "core.machine", "core.loader", "core.prompt", "core.spans", "core.constraints",
     "core.policies", "core.config", "core.results", "core.corpus"),
    ("core.llama",),  # the bindings: llama.cpp through llama-cpp-python
    ("core.steps", "core.models"),  # what a turn asks of the loop; model files, cuts, settings
    # the engine's parts
    ("core.specprefill", "core.decoding", "core.kv", "core.chat", "core.tool_section", "core.speculator"),
    ("core.engine", "core.startup"),
    ("core.runtime", "core.turn_request"),  # the model thread and what a turn asks of it
)
# What the gateway may import of the session layer: the manager and the types it hands out,
# and what app wiring builds the layer from (gateway/app.py opens it in its cleanup contexts).
SESSION_FACE = ("sessions.manager", "sessions.session", "sessions.layer")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """Every module ``path`` imports: the project's own by module name, others by top package."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if sub in known else node.module)
    return {name if name.split(".")[0] in PACKAGES else name.split(".")[0] for name in out}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, known) for name, path in known.items()}


def floor(module: str) -> int:
    for i, names in enumerate(CORE_FLOORS):
        if any(module == n or module.startswith(n + ".") for n in names):
            return i
    raise AssertionError(f"{module} sits on no floor of core: add it to CORE_FLOORS")


def test_layers_import_downward(graph: dict[str, set[str]]) -> None:
    upward = [(a, b) for a, deps in graph.items() for b in deps
              if b.split(".")[0] in LAYERS and LAYERS[b.split(".")[0]] > LAYERS[a.split(".")[0]]]
    assert upward == []


def test_core_floors_import_downward(graph: dict[str, set[str]]) -> None:
    core = {m: deps for m, deps in graph.items() if m.startswith("core.")}
    upward = [(a, b) for a, deps in core.items() for b in deps if b.startswith("core.") and floor(b) > floor(a)]
    assert upward == []


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles(graph: dict[str, set[str]]) -> None:
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_llama_cpp_only_in_core_llama(graph: dict[str, set[str]]) -> None:
    outside = sorted(m for m, deps in graph.items() if "llama_cpp" in deps and not m.startswith("core.llama."))
    assert outside == []


def test_gateway_meets_sessions_through_their_face(graph: dict[str, set[str]]) -> None:
    reaching = sorted((a, b) for a, deps in graph.items() if a.startswith("gateway.") for b in deps
                      if (b.startswith("sessions.") and b not in SESSION_FACE) or b.startswith("core.runtime"))
    assert reaching == []


def worker_door_uses(path: Path) -> list[tuple[int, str]]:
    """Where ``path`` hands the model thread a callable: ``inspect(...)`` (the tests' door), an
    assignment to a worker's ``idle``, or a lambda or nested function passed to ``call``,
    ``post`` or ``turn`` on something named ``worker``."""
    found = []
    tree = ast.parse(path.read_text(), str(path))
    local_defs = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = ast.unparse(node.func.value)
            if node.func.attr == "inspect" and "worker" in target:
                found.append((node.lineno, "inspect"))
            elif node.func.attr in ("call", "post", "turn") and "worker" in target:
                for arg in node.args:
                    if isinstance(arg, ast.Lambda) or (isinstance(arg, ast.Name) and arg.id in local_defs):
                        found.append((node.lineno, f"{node.func.attr}({ast.unparse(arg)})"))
        elif isinstance(node, ast.Assign):
            found += [(node.lineno, ast.unparse(t)) for t in node.targets
                      if isinstance(t, ast.Attribute) and t.attr == "idle" and "worker" in ast.unparse(t.value)]
    return sorted(found)


def test_no_callable_crosses_from_the_event_loops_side_into_the_model_thread() -> None:
    """sessions/ and gateway/ hand the model thread plain messages (core.runtime.messages)."""
    crossing = [(str(p.relative_to(ROOT)), *use) for pkg in ("sessions", "gateway")
                for p in sorted((ROOT / pkg).rglob("*.py")) for use in worker_door_uses(p)]
    assert crossing == []


def test_the_door_check_sees_a_closure(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("async def f(self, worker):\n    def g(e):\n        return e\n"
                   "    await self.worker.call(lambda e: e)\n    await worker.call(g)\n    worker.post(Forget(x))\n"
                   "    worker.idle = g\n    await self.worker.inspect(g)\n")
    assert [u[1] for u in worker_door_uses(src)] == ["call(lambda e: e)", "call(g)", "worker.idle", "inspect"]


def test_the_worker_refuses_a_callable_where_a_message_belongs() -> None:
    import asyncio

    from core.runtime.worker import ModelWorker

    worker = ModelWorker.__new__(ModelWorker)
    worker._engine = object()  # type: ignore[assignment]  # as if started: the type check comes first
    with pytest.raises(TypeError, match="Render, Settle, Describe"):
        asyncio.run(worker.call(lambda engine: engine))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Forget, Wake"):
        worker.post(lambda engine: engine)  # type: ignore[arg-type]


def cell_changing_calls() -> set[str]:
    """The methods of core/llama/context.py marked ``@changes_cells``."""
    tree = ast.parse((ROOT / "core/llama/context.py").read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
            and any(isinstance(d, ast.Name) and d.id == "changes_cells" for d in n.decorator_list)}


def cell_changes(path: Path, names: set[str]) -> list[tuple[int, str]]:
    """Where ``path`` calls one of ``names`` as a method."""
    return sorted((n.lineno, n.func.attr) for n in ast.walk(ast.parse(path.read_text(), str(path)))
                  if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in names)


def test_the_marked_cell_changes_have_names_of_their_own() -> None:
    """A call found by name is a cell change only if nothing else defines that name."""
    names = cell_changing_calls()
    assert {"clear_cells", "remove_from", "move_labels", "load_state", "copy_seq", "make_view"} <= names
    elsewhere = sorted((str(p.relative_to(ROOT)), n.name) for p in modules().values()
                       if p != ROOT / "core/llama/context.py" for n in ast.walk(ast.parse(p.read_text()))
                       if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name in names)
    assert elsewhere == []


def test_only_core_kv_changes_cells() -> None:
    """Removing, moving, copying or loading KV cells happens in core/kv/ alone, beside the
    bookkeeping it keeps in step (core.kv.positions); decoding only appends."""
    names = cell_changing_calls()
    outside = [(str(p.relative_to(ROOT)), *use) for m, p in modules().items()
               if not m.startswith(("core.kv.", "core.llama.")) for use in cell_changes(p, names)]
    assert outside == []


def test_the_cell_check_sees_a_cell_change(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("def f(seq, ctx, items):\n    items.remove(1)\n    seq.remove_from(3)\n"
                   "    ctx.seq(0).shift_cells(0, 1, 1)\n    seq.decode([1], 0)\n")
    assert cell_changes(src, cell_changing_calls()) == [(3, "remove_from"), (4, "shift_cells")]
