"""The package's shape: layers import downwards only, the core engine imports no plug-in, the
server reaches the engine through its public API, the HTTP programs stay free of torch, and
``import minillm.engine`` stays light.

The layers, lowest first (a module may import its own layer and the ones before it):

- the foundations ``minillm.settings``, ``minillm.cli``, ``minillm.sizes`` (no torch);
- ``data`` (tokens and corpus), ``model`` (the GPT), ``decoding`` (from logits to text);
- ``machine``: the hardware measured, and chapter 1's roofline, which times the model's decode
  steps, so it sits on the model and decoding rather than beneath them;
- ``train``; ``engine`` (the core); ``speedups`` and ``distributed`` (plug-ins); ``export``;
  ``bench`` and ``python -m minillm``; then ``server``.

``minillm.engine.build`` is the one module allowed to reach up: ``build_engine`` is where the
plug-ins are wired into the core.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def loaded_modules(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running ``code``."""
    probe = f"{code}\nimport sys\nprint('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_the_router_and_the_load_generator_import_neither_torch_nor_the_engine():
    programs = sorted(m for m in import_graph() if m.startswith(("server.router", "server.loadgen")))
    loaded = loaded_modules("\n".join(f"import {m}" for m in programs))
    assert "torch" not in loaded
    assert not {m for m in loaded if m.startswith("minillm.engine")}
    assert {"server.router.__main__", "server.router.bench", "server.loadgen.__main__"} <= set(programs) <= loaded


def test_the_naive_loop_does_not_load_the_grammar_machinery():
    loaded = loaded_modules("import minillm.decoding.generate")
    assert "minillm.decoding.sampling" in loaded
    assert "minillm.decoding.structured" not in loaded and "llguidance" not in loaded


def test_importing_the_engine_loads_no_checkpoints_quantization_or_progress_bars():
    loaded = loaded_modules("import minillm.engine")
    assert {"minillm.engine.llm_engine", "torch"} <= loaded
    assert not loaded & {"minillm.model.checkpoint", "minillm.speedups.quant", "minillm.train.trainer", "minillm.engine.llm",
                         "minillm.engine.build", "tqdm.auto"}
    from minillm.engine import LLM, build_engine  # still reachable, on first use

    assert LLM.__name__ == "LLM" and callable(build_engine)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports, at any depth of the file (function-level
    imports included). ``from a import b`` points at ``a.b`` when that is a module, else ``a``."""
    files = {module_name(p): p for top in ("minillm", "server") for p in (ROOT / top).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in files}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    edges.add(target if target in files else base)
        graph[name] = {e for e in edges if e in files and e != name}
    lazy = __import__("minillm.engine", fromlist=["_LAZY"])._LAZY
    graph["minillm.engine"] |= set(lazy.values())
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_there_are_no_import_cycles_not_even_in_function_level_imports():
    graph = import_graph()
    assert "minillm.model.checkpoint" in graph["minillm.train.trainer"]  # the graph does see real edges
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_minillm_never_imports_server():
    graph = import_graph()
    assert not {m for m, deps in graph.items() if m.startswith("minillm") for d in deps if d.startswith("server")}


LAYERS = [
    ("minillm", "minillm.settings", "minillm.cli", "minillm.sizes"),
    ("minillm.data",),
    ("minillm.model",),
    ("minillm.decoding",),
    ("minillm.machine",),
    ("minillm.train",),
    ("minillm.engine",),
    ("minillm.speedups", "minillm.distributed"),
    ("minillm.export",),
    ("minillm.bench", "minillm.__main__"),
    ("server",),
]
WIRING = {"minillm.engine.build"}  # build_engine: where plug-ins are wired into the core


def layer_of(module: str) -> int:
    """The index in ``LAYERS`` of the longest prefix that names ``module``'s layer."""
    best, rank = "", -1
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
                best, rank = prefix, i
    assert rank >= 0, f"{module} is in no layer: add its folder to LAYERS"
    return rank


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every edge from a module to a module of a higher layer, wiring excepted."""
    return sorted(f"{m} -> {d}" for m, deps in graph.items() if m not in WIRING
                  for d in deps if layer_of(d) > layer_of(m))


def test_every_import_points_down_the_layers():
    graph = import_graph()
    assert upward_imports(graph) == []


def test_the_layer_check_catches_a_planted_upward_import():
    graph = import_graph()
    planted = {**graph, "minillm.engine.scheduler": graph["minillm.engine.scheduler"] | {"minillm.speedups.packed"},
               "minillm.data.corpus": graph["minillm.data.corpus"] | {"minillm.model.gpt"}}
    assert set(upward_imports(planted)) - set(upward_imports(graph)) == {
        "minillm.data.corpus -> minillm.model.gpt", "minillm.engine.scheduler -> minillm.speedups.packed"}
    assert upward_imports({"minillm.engine.build": {"minillm.speedups.packed"}}) == []  # the wiring may


def test_the_core_engine_imports_no_plug_in():
    graph = import_graph()
    core = {m: deps for m, deps in graph.items() if m.startswith("minillm.engine") and m not in WIRING}
    assert "minillm.engine.llm_engine" in core and "minillm.engine.model_runner" in core
    plugged = {f"{m} -> {d}" for m, deps in core.items() for d in deps
               if d.startswith(("minillm.speedups", "minillm.distributed"))}
    assert plugged == set()


def attribute_uses(path: Path, names: set[str]) -> list[str]:
    """``obj.NAME`` uses in a file, for each NAME in ``names``, as ``file:line .NAME``."""
    tree = ast.parse(path.read_text())
    return [f"{path.name}:{n.lineno} .{n.attr}" for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in names]


def test_the_server_reaches_the_engine_through_its_public_api_only():
    """The engine's parts (scheduler, allocator, runner) are its own; and what a step ran is
    read on the engine's thread (the engine loop), never from the dashboard's."""
    server = sorted((ROOT / "server").rglob("*.py"))
    assert attribute_uses(server[0].parent / "engine_loop.py", {"engine"})  # (the scan does see attributes)
    assert [u for p in server for u in attribute_uses(p, {"scheduler", "allocator", "runner"})] == []
    assert [u for p in server if p.name != "engine_loop.py" for u in attribute_uses(p, {"last_step"})] == []
    internals = {"minillm.engine.scheduler", "minillm.engine.block_allocator", "minillm.engine.model_runner",
                 "minillm.engine.kv_cache"}
    graph = import_graph()
    assert {f"{m} -> {d}" for m, deps in graph.items() if m.startswith("server") for d in deps & internals} == set()
