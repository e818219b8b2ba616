"""The package's import direction (issue 33): every module sits on a layer and imports only from
its own layer or those below, counting function-local imports too (a lazy import is still an
arrow) and the package `__init__`s an import runs (importing `a.b.c` runs `a/b/__init__.py`
first); no circles among modules. Read from the source with `ast`, nothing imported.

    python tests/test_import_layers.py     # the layers' upward arrows, circles and lazy imports

UPWARD lists the arrows that still run up, each with why; the contract is that no new one appears
and that a listed one that is gone is taken off the list (the test says so).

Imports sit at module top. A function-local import of a project module says why it is local with a
`# lazy: <why>` comment on its line or the line above: an optional dependency (the C++ extension,
CUDA, torch), start-up time (`import powerinfer_jax` and the CLIs import no jax; gguf only for
GGUF files), or a cycle.
"""
from __future__ import annotations

import ast
import collections
import sys
from pathlib import Path

PKG = "powerinfer_jax"
ROOT = Path(__file__).resolve().parents[1]

# bottom to top; a module's layer is the one of its longest matching prefix
LAYERS = [
    ("foundation", ["errors", "_interrupt", "_machine", "_pypi", "_pij_ext", "_pij_cuda",
                    "tokenizer"]),
    ("formats", ["config", "cache", "cache_limit", "checkpoint.quants"]),
    ("checkpoint", ["checkpoint"]),
    ("ops", ["ops", "_bench_ops"]),
    ("models", ["models"]),
    ("sparsity", ["sparsity"]),
    ("runtime", ["runtime"]),
    ("cli", ["_cli"]),  # what every command shares: flags, errors, the machine's description
    ("library", ["api", "synthetic", "sparsify", "bench"]),
    ("face", [""]),  # the package's __init__: what `import powerinfer_jax` gives
    ("commands", ["evaluate", "generate", "calibrate", "serve", "server", "cache_cli"]),
]

# (importer, imported): arrows that still run up, with the reason each is still there
UPWARD: dict[tuple[str, str], str] = {
    ("cache", "cache_cli"):
        "`python -m powerinfer_jax.cache` must run the cache's command (issue 53): only the "
        "module's __main__ block imports it, never the library",
}

EXTENSIONS = ("_pij_ext", "_pij_cuda")  # compiled modules: no source


def modules(root: Path = ROOT) -> dict[str, Path | None]:
    out: dict[str, Path | None] = {f"{PKG}.{e}": None for e in EXTENSIONS}
    for p in sorted((root / PKG).rglob("*.py")):
        parts = p.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def packages_above(mod: str) -> list[str]:
    """"a.b.c" -> ["a", "a.b"]: the packages whose __init__ importing a.b.c runs first."""
    parts = mod.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def graph(root: Path = ROOT):
    """{importer: {imported: lazy}} over the package's modules (lazy: only inside functions),
    counting the package __init__s an import runs, and the function-local imports of project
    modules per module: [(line, says why)]."""
    mods = modules(root)

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, dict[str, bool]] = collections.defaultdict(dict)
    lazy: dict[str, list[tuple[int, bool]]] = collections.defaultdict(list)
    for mod, path in mods.items():
        if path is None:
            continue
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        lines = path.read_text(encoding="utf-8").splitlines()

        def visit(node, in_function: bool):
            for ch in ast.iter_child_nodes(node):
                inner = in_function or isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef))
                if isinstance(ch, ast.Import):
                    targets = [a.name for a in ch.names]
                elif isinstance(ch, ast.ImportFrom):
                    base = ch.module or ""
                    if ch.level:
                        up = package.split(".")[:len(package.split(".")) - ch.level + 1]
                        base = ".".join(up + ([base] if base else []))
                    targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                               for a in ch.names]
                else:
                    visit(ch, inner)
                    continue
                ours = [t for t in targets if t == PKG or t.startswith(PKG + ".")]
                if ours and in_function:
                    said = any("# lazy:" in ln for ln in lines[ch.lineno - 2:ch.end_lineno])
                    lazy[mod].append((ch.lineno, said))
                for t in ours:
                    r = resolve(t)
                    if not r or r == mod:
                        continue
                    # importing r first runs the __init__ of every package above it that mod
                    # is not inside already: an arrow to each (the circle through the
                    # checkpoint package's __init__ ran this way)
                    for target in [*packages_above(r), r]:
                        if target in mods and not (mod == target or mod.startswith(target + ".")):
                            edges[mod][target] = edges[mod].get(target, True) and in_function
        visit(ast.parse("\n".join(lines)), False)
    return edges, lazy


def layer(mod: str) -> int:
    short = mod[len(PKG) + 1:] if mod != PKG else ""
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for pre in prefixes:
            hit = short == pre or short.startswith(pre + ".") or (pre == "" and short == "")
            if hit and len(pre) > best_len:
                best, best_len = i, len(pre)
    if best is None:
        raise AssertionError(f"{mod}: on no layer of tests/test_import_layers.py LAYERS")
    return best


def upward(edges) -> dict[tuple[str, str], bool]:
    n = len(PKG) + 1
    return {(a[n:], b[n:]): lazy for a, targets in edges.items() for b, lazy in targets.items()
            if layer(b) > layer(a)}


def circles(edges) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = 0
    for start in list(edges):
        if start in index:
            continue
        work = [(start, iter(edges.get(start, {})))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(edges.get(w, {}))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_every_module_is_on_a_layer():
    for mod in modules():
        layer(mod)


def test_no_new_upward_import():
    edges, _ = graph()
    found = upward(edges)
    new = sorted(set(found) - set(UPWARD))
    assert not new, ("imports that run up the layers (tests/test_import_layers.py LAYERS); move "
                     f"the code down or the import up: {new}")
    gone = sorted(set(UPWARD) - set(found))
    assert not gone, f"no longer upward: take them off UPWARD: {gone}"


def test_no_circles_outside_the_listed_upward_imports():
    edges, _ = graph()
    n = len(PKG) + 1
    kept = {a: {b: lz for b, lz in t.items() if (a[n:], b[n:]) not in UPWARD}
            for a, t in edges.items()}
    assert circles(kept) == []


def test_an_import_counts_the_package_inits_it_runs(tmp_path):
    """`from pkg.b import m` inside pkg.a is an arrow to pkg.b's __init__ too: the circle
    checkpoint -> ops._ffi -> checkpoint ran through one."""
    pkg = tmp_path / PKG
    for d, files in {"": {"__init__.py": ""}, "a": {"__init__.py": "", "x.py": (
            "def f():\n    from powerinfer_jax.b import m  # lazy: test\n")},
                     "b": {"__init__.py": "from powerinfer_jax.b import n\n", "m.py": "",
                           "n.py": "from powerinfer_jax.a import x\n"}}.items():
        (pkg / d).mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (pkg / d / name).write_text(text)
    edges, _ = graph(tmp_path)
    assert set(edges[f"{PKG}.a.x"]) == {f"{PKG}.b", f"{PKG}.b.m"}
    assert circles(edges) == [sorted([f"{PKG}.a.x", f"{PKG}.b", f"{PKG}.b.n"])]


def test_every_function_local_import_says_why():
    _, lazy = graph()
    silent = [f"{mod}:{line}" for mod, found in sorted(lazy.items()) for line, said in found
              if not said]
    assert not silent, ("function-local imports of project modules without a `# lazy: <why>` "
                        f"comment (move them to the module's top, or say why not): {silent}")


if __name__ == "__main__":
    e, lazy = graph(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
    n = sum(len(v) for v in lazy.values())
    silent = sum(not said for v in lazy.values() for _, said in v)
    print(f"function-local imports of project modules: {n} ({silent} without a `# lazy:` why)")
    for (a, b), lz in sorted(upward(e).items()):
        print(f"upward: {a} -> {b}{' (in a function)' if lz else ''}")
    for c in circles(e):
        print(f"circle of {len(c)}: {', '.join(c)}")
