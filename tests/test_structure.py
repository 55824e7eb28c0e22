"""The layout's rules (docs/architecture.md): no import cycle, the runtime never
loads the tooling, no module over 600 lines, and the public API the docs promise."""

import ast
import pathlib
import subprocess
import sys

import difflet_tpu

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAPPED = {"kernels": "difflet_tpu.kernels", "models": "difflet_tpu.models"}
TOOLING = ("difflet_tpu.tools", "difflet_tpu.bench", "difflet_tpu.check")
MAX_LINES = 600


def _modules() -> dict[str, pathlib.Path]:
    """dotted name -> file of every module of the installed package."""
    out = {}
    for folder, package in [("difflet_tpu", "difflet_tpu"), *MAPPED.items()]:
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def _resolve(name: str, modules: dict) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _top_level_imports(path: pathlib.Path, me: str, modules: dict) -> set[str]:
    """Modules of the package imported at module level (not inside functions:
    those run late and are how a module breaks a cycle on purpose)."""
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in tree.body:
        nodes = [node]
        if isinstance(node, (ast.If, ast.Try)):  # `if TYPE_CHECKING:` / guarded imports count too
            nodes = list(ast.walk(node))
        for n in nodes:
            if isinstance(n, ast.Import):
                found |= {a.name for a in n.names}
            elif isinstance(n, ast.ImportFrom):
                base = n.module or ""
                if n.level:
                    pkg = me if is_pkg else me.rpartition(".")[0]
                    for _ in range(n.level - 1):
                        pkg = pkg.rpartition(".")[0]
                    base = f"{pkg}.{base}" if base else pkg
                # `from pkg import sub` imports pkg.sub; `from mod import name` imports mod
                found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in n.names}
    return {r for r in (_resolve(f, modules) for f in found if f.startswith("difflet_tpu")) if r and r != me}


def test_no_import_cycle():
    modules = _modules()
    graph = {m: _top_level_imports(p, m, modules) for m, p in modules.items()}
    cycles, state = [], {}

    def visit(m, stack):
        state[m] = 1
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_cycle(tmp_path, monkeypatch):
    """The check above is not blind: two modules importing each other are a cycle."""
    (tmp_path / "difflet_tpu").mkdir()
    (tmp_path / "difflet_tpu" / "__init__.py").write_text("")
    (tmp_path / "difflet_tpu" / "a.py").write_text("from difflet_tpu import b\n")
    (tmp_path / "difflet_tpu" / "b.py").write_text("from difflet_tpu.a import x\n")
    modules = {"difflet_tpu": None, "difflet_tpu.a": tmp_path / "difflet_tpu/a.py",
               "difflet_tpu.b": tmp_path / "difflet_tpu/b.py"}
    assert _top_level_imports(modules["difflet_tpu.a"], "difflet_tpu.a", modules) == {"difflet_tpu.b"}
    assert _top_level_imports(modules["difflet_tpu.b"], "difflet_tpu.b", modules) == {"difflet_tpu.a"}


def test_runner_reads_the_site_planner():
    """The Runner's pad rule comes from the one planner (`parallel.site_plan`): runner.py
    imports no kernel module, at module level or in a function."""
    path = ROOT / "difflet_tpu" / "runner.py"
    names = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.Import):
            names |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom):
            names |= {f"{n.module}.{a.name}" for a in n.names}
    assert not [m for m in names if "kernels" in m], names
    assert "difflet_tpu.parallel.site_plan" in names


def test_runtime_loads_no_tooling():
    """A fresh process that imports the Runner, the loader, every port, the encoders,
    the VAEs and the pipelines loads nothing of difflet_tpu.tools or difflet_tpu.bench."""
    code = """
import importlib, pkgutil, sys
import difflet_tpu
from difflet_tpu import runner, loading
import difflet_tpu.models as m
for name in m.PORTS:
    m.spec(name)
for pkg in ("encoders", "vae", "pipeline"):
    try:
        p = importlib.import_module("difflet_tpu." + pkg)
    except ModuleNotFoundError:
        continue
    for info in pkgutil.walk_packages(p.__path__, p.__name__ + "."):
        importlib.import_module(info.name)
difflet_tpu.Runner, difflet_tpu.load_transformer
tooling = %r
print(sorted(k for k in sys.modules if any(k == t or k.startswith(t + ".") for t in tooling)))
""" % (TOOLING,)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/",
                         env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]", out.stdout


def test_no_module_over_600_lines():
    """Every module of the installed package: difflet_tpu/ and the folders installed inside it."""
    long = {str(p.relative_to(ROOT)): n for folder in ("difflet_tpu", *MAPPED) for p in (ROOT / folder).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_public_api():
    for name in ("Config", "make_mesh", "Runner", "load_transformer"):
        assert name in difflet_tpu.__all__ and getattr(difflet_tpu, name) is not None
    from difflet_tpu.runner import Runner
    from difflet_tpu.loading.load import load_transformer

    assert difflet_tpu.Runner is Runner and difflet_tpu.load_transformer is load_transformer
