"""The house rules of the code, read from the sources with ``ast`` (nothing is imported):

* who may import whom (the rooms of ``DESIGN``: ``nodes -> client / wire / nested``, the engine
  never imports ComfyUI, ``text`` and ``denoise`` never import the pool, the client or the CLI);
* no import cycle between modules, at any depth, counting imports inside functions and under
  ``TYPE_CHECKING``;
* no private name imported from another module; no module name prefix standing in for a folder;
* a function-level import only where it keeps start-up fast or an optional dependency optional,
  and saying so.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

#: Modules the engine may import inside a function without saying why at the site: heavy or
#: optional dependencies (seconds of import time, or absent on some machines).
HEAVY = {
    "transformers": "takes seconds to import",
    "bitsandbytes": "optional on machines without its kernels; loads CUDA libraries",
    "ltx_core": "loads the LTX-2 model code",
    "triton": "optional (GPU machines only)",
    "av": "only the MP4 writer needs it",
    "accelerate": "only the accelerate placement needs it",
    "sentencepiece": "only SentencePiece tokenizers need it",
    "google": "protobuf, only SentencePiece tokenizers need it",
    "tqdm": "only the CLI's progress bars need it",
    "torch._dynamo": "torch's compiler stack, only for compile",
    "gguf": "only GGUF files need it (numpy-heavy reader)",
}

#: Modules the ComfyUI nodes may import from the engine: the client, the wire, and the
#: dependency-free leaves the node definitions need (choices, the text encoder's config), and the
#: GGUF reader (ComfyUI's model detection reads a GGUF transformer's header).
NODE_ROOMS = ("ltx_mgpu.client", "ltx_mgpu.wire", "ltx_mgpu.nested", "ltx_mgpu.choices", "ltx_mgpu.settings",
              "ltx_mgpu.text.config", "ltx_mgpu.denoise.plan", "ltx_mgpu.quantized.ggml", "ltx_mgpu.heartbeat")
#: Top-level names of ComfyUI's own modules (the engine never imports them).
COMFY_MODULES = {"comfy", "comfy_extras", "comfy_api", "comfy_execution", "folder_paths", "server", "execution",
                 "latent_preview", "node_helpers"}
#: room -> rooms it must never import.
FORBIDDEN = {
    "ltx_mgpu.text": ("ltx_mgpu.pool", "ltx_mgpu.client", "ltx_mgpu.cli"),
    "ltx_mgpu.denoise": ("ltx_mgpu.pool", "ltx_mgpu.client", "ltx_mgpu.cli", "ltx_mgpu.text"),
    "ltx_mgpu.wire": ("ltx_mgpu.pool", "ltx_mgpu.client", "ltx_mgpu.cli", "ltx_mgpu.text", "ltx_mgpu.denoise"),
    "ltx_mgpu.pool": ("ltx_mgpu.client", "ltx_mgpu.cli"),
    "ltx_mgpu.client": ("ltx_mgpu.cli", "ltx_mgpu.pool"),
    "ltx_mgpu.assets": ("ltx_mgpu.pool", "ltx_mgpu.client", "ltx_mgpu.cli"),
}
#: The leaf utilities: they import no other ltx_mgpu module but each other.
LEAVES = ("ltx_mgpu.files", "ltx_mgpu.identity", "ltx_mgpu.nested", "ltx_mgpu.choices", "ltx_mgpu.cancellation",
          "ltx_mgpu.settings", "ltx_mgpu.shards", "ltx_mgpu.heartbeat", "ltx_mgpu.finite")


@dataclass(frozen=True)
class Edge:
    """``importer`` imports ``target`` (a module of this repository) at ``line``."""

    importer: str
    target: str
    line: int
    in_function: bool
    names: tuple[str, ...]
    comment: bool


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> dict[str, Path]:
    """Every module of the engine and of the nodes, by dotted name."""
    files = [*REPO.glob("ltx_mgpu/**/*.py"), *REPO.glob("nodes/*.py")]
    return {module_name(p): p for p in files}


MODULES = sources()


def _owner(dotted: str) -> str | None:
    """The repository module a dotted import target lives in (``a.b.c`` -> ``a.b`` when ``c`` is a name)."""
    while dotted:
        if dotted in MODULES:
            return dotted
        dotted = dotted.rpartition(".")[0]
    return None


def _resolve(importer: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(name: str, path: Path) -> tuple[list[Edge], list[tuple[str, int, bool, bool]]]:
    """The edges to repository modules, and every import's ``(top module, line, in_function, commented)``."""
    src = path.read_text()
    lines = src.splitlines()
    tree = ast.parse(src)
    edges, external = [], []

    def commented(node: ast.AST) -> bool:
        first, last = node.lineno - 1, node.end_lineno - 1
        above = lines[first - 1].strip() if first > 0 else ""
        return any("#" in lines[i] for i in range(first, last + 1)) or above.startswith("#")

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    target = _owner(alias.name)
                    if target:
                        edges.append(Edge(name, target, child.lineno, inner, (), commented(child)))
                    else:
                        external.append((alias.name, child.lineno, inner, commented(child)))
            elif isinstance(child, ast.ImportFrom):
                base = _resolve(name, child, path.name == "__init__.py")
                for alias in child.names:
                    target = _owner(f"{base}.{alias.name}") if f"{base}.{alias.name}" in MODULES else _owner(base)
                    if target:
                        names = () if f"{base}.{alias.name}" in MODULES else (alias.name,)
                        edges.append(Edge(name, target, child.lineno, inner, names, commented(child)))
                    else:
                        external.append((base, child.lineno, inner, commented(child)))
            visit(child, inner)

    visit(tree, False)
    return edges, external


EDGES: list[Edge] = []
EXTERNAL: dict[str, list[tuple[str, int, bool, bool]]] = {}
for _name, _path in MODULES.items():
    _edges, _external = _imports(_name, _path)
    EDGES += [e for e in _edges if e.target != _name]
    EXTERNAL[_name] = _external


def _in(module: str, room: str) -> bool:
    return module == room or module.startswith(room + ".")


def cycles(edges: list[Edge]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for e in edges:
        graph[e.importer].add(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in list(graph):
        if v not in index:
            connect(v)
    return found


def test_there_is_no_import_cycle_at_any_depth():
    found = cycles(EDGES)
    assert not found, f"import cycles (imports inside functions count): {found}"


def package_of(module: str) -> str:
    """The package (folder) a module belongs to: ``a.b.c`` -> ``a.b``; a package's ``__init__``
    is the package itself. Entry points (``__main__``) are nodes of their own: they start the
    program and belong to no layer."""
    if module.endswith(".__main__") or MODULES[module].name == "__init__.py":
        return module
    return module.rpartition(".")[0] or module


def package_edges(edges: list[Edge]) -> list[Edge]:
    """``edges`` between packages (folders): a package importing its own subpackage counts, and
    so does the reverse, so a parent and a child that import each other are a loop."""
    out = []
    for e in edges:
        a, b = package_of(e.importer), package_of(e.target)
        if a != b:
            out.append(Edge(a, b, e.line, e.in_function, (), e.comment))
    return out


def test_there_is_no_import_cycle_between_packages():
    """Packages are layers: if ``text.gemma`` imports ``text.nf4``, nothing in ``text.nf4`` may
    import ``text.gemma`` (and a package's own modules may not import a subpackage that imports
    them back)."""
    found = cycles(package_edges(EDGES))
    detail = [f"{e.importer}:{e.line} -> {e.target}" for e in EDGES
              if any(package_of(e.importer) in c and package_of(e.target) in c and
                     package_of(e.importer) != package_of(e.target) for c in found)]
    assert not found, f"package loops: {found}\n" + "\n".join(detail)


def test_the_cycle_finder_sees_cycles_through_function_level_imports():
    """A cycle closed by an import inside a function (the way four cycles used to hide) is found."""
    edges = [Edge("a", "b", 1, False, (), False), Edge("b", "c", 1, False, (), False),
             Edge("c", "a", 9, True, (), False), Edge("c", "d", 1, False, (), False)]
    assert cycles(edges) == [["a", "b", "c"]]


def test_the_nodes_import_only_the_client_the_wire_and_the_leaves():
    bad = [f"{e.importer}:{e.line} imports {e.target}" for e in EDGES
           if _in(e.importer, "nodes") and _in(e.target, "ltx_mgpu")
           and not any(_in(e.target, room) for room in NODE_ROOMS)]
    assert not bad, "nodes/ may import " + ", ".join(NODE_ROOMS) + " only:\n" + "\n".join(bad)


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_each_room_imports_only_what_it_may(room):
    bad = [f"{e.importer}:{e.line} imports {e.target}" for e in EDGES
           if _in(e.importer, room) and any(_in(e.target, f) for f in FORBIDDEN[room])]
    assert not bad, f"{room} must not import {FORBIDDEN[room]}:\n" + "\n".join(bad)


def test_the_leaf_utilities_import_no_other_engine_module():
    bad = [f"{e.importer}:{e.line} imports {e.target}" for e in EDGES
           if e.importer in LEAVES and e.target not in LEAVES]
    assert not bad, "\n".join(bad)


def test_the_engine_never_imports_comfyui():
    bad = [f"{name}:{line} imports {mod}" for name, imports in EXTERNAL.items() if _in(name, "ltx_mgpu")
           for mod, line, _, _ in imports if mod.split(".")[0] in COMFY_MODULES]
    assert not bad, "\n".join(bad)


def test_no_private_name_is_imported_from_another_module():
    bad = [f"{e.importer}:{e.line} imports {n} from {e.target}" for e in EDGES for n in e.names
           if n.startswith("_") and not n.startswith("__")]
    assert not bad, "\n".join(bad)


def test_function_level_imports_say_why_they_are_deferred():
    """Inside a function: a heavy or optional dependency (:data:`HEAVY`), or an import whose line
    (or the line above) says why; the CLI defers everything so that ``--help`` stays fast, and its
    package says so once."""
    bad = []
    for name, path in MODULES.items():
        if not _in(name, "ltx_mgpu") or _in(name, "ltx_mgpu.cli"):
            continue
        for e in EDGES:
            if e.importer == name and e.in_function and not e.comment:
                bad.append(f"{path.relative_to(REPO)}:{e.line} imports {e.target} inside a function")
        for mod, line, in_function, comment in EXTERNAL[name]:
            heavy = any(_in(mod, h) for h in HEAVY)
            if in_function and not heavy and not comment:
                bad.append(f"{path.relative_to(REPO)}:{line} imports {mod} inside a function")
    assert not bad, ("move these imports to the top of the module, or say in a comment why they wait:\n"
                     + "\n".join(bad))


def test_no_module_name_prefix_stands_in_for_a_folder():
    """``shm_send`` / ``shm_receive`` beside ``shm`` is a package waiting to happen."""
    by_package: dict[str, list[str]] = defaultdict(list)
    for name in MODULES:
        package, _, leaf = name.rpartition(".")
        if leaf and not (REPO / Path(*name.split("."))).is_dir():
            by_package[package].append(leaf)
    bad = []
    for package, leaves in by_package.items():
        prefixes: dict[str, list[str]] = defaultdict(list)
        for leaf in leaves:
            if "_" in leaf.strip("_"):
                prefixes[leaf.strip("_").split("_")[0]].append(leaf)
        for prefix, group in prefixes.items():
            if len(group) > 1 or prefix in leaves:
                bad.append(f"{package}: {sorted(group + ([prefix] if prefix in leaves else []))}")
    assert not bad, "make a package of these:\n" + "\n".join(bad)


#: What starts a process of ours (a pool, ranks, a command), by the module or name imported; the
#: unit tier imports none of it.
PROCESS_STARTERS = {"subprocess", "multiprocessing", "torch.multiprocessing", "PoolClient", "run_ranks",
                    "run_rank_processes", "cpu_pool"}
#: The unit tier's files that run a tool, not the product: ruff (style) and Node.js (the panel's view).
TOOL_RUNNERS = {"test_style.py": "ruff", "test_workflows.py": "node"}


def _imported(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names |= {node.module or ""} | {a.name for a in node.names}
    return names


def test_the_unit_tier_starts_no_process_of_ours():
    """``tests/unit/`` runs in one process; pools, ranks and commands are ``tests/integration/``'s
    (docs/testing.md, the tiers)."""
    bad = []
    for path in sorted((REPO / "tests" / "unit").glob("*.py")):
        used = sorted(_imported(ast.parse(path.read_text())) & PROCESS_STARTERS)
        if used and not (path.name in TOOL_RUNNERS and used == ["subprocess"]):
            bad.append(f"{path.name}: {used}")
    assert not bad, bad
    for name, tool in TOOL_RUNNERS.items():  # and those two run only their tool
        calls = re.findall(r"subprocess\.run\(\[([^,\]]+)", (REPO / "tests" / "unit" / name).read_text())
        assert calls and all(tool in c for c in calls), (name, calls)


def test_test_files_have_unique_names():
    """pytest imports the test files by their base names (``rootdir`` import mode, no packages
    under ``tests/``): two files of one name in different tiers stop the whole run at collection."""
    seen: dict[str, list[str]] = {}
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        seen.setdefault(path.name, []).append(str(path.relative_to(REPO)))
    assert not {name: paths for name, paths in seen.items() if len(paths) > 1}
