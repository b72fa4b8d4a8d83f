"""The package's shape: imports point one way, the HTTP programs stay free of torch, and
``import minillm.engine`` stays light."""

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
    loaded = loaded_modules("import server.router.__main__, server.router.config, server.router.bench, server.loadgen.__main__")
    assert "torch" not in loaded
    assert not {m for m in loaded if m.startswith("minillm.engine")}
    assert "server.router" in loaded  # (the probe did import them)


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
