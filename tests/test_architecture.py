"""The layout's rules, read from the source (every import, at module level or in a
function): imports point one way, `bridge -> hisparse_jax -> cpu_kernels,
pallas_kernels -> jax`; the runtime wings never import what measures or serves
them; only bridge/ imports torch or vLLM; the core imports without the extras."""

import ast
import pathlib
import re
import subprocess
import sys

import pytest

from hisparse_jax.backends import BACKENDS

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUNTIME = ("hisparse_jax/config.py", "hisparse_jax/backends.py", "hisparse_jax/validate.py",
           "hisparse_jax/compat.py", "hisparse_jax/capacity.py", "hisparse_jax/cache",
           "hisparse_jax/attention", "hisparse_jax/offload")
ABOVE_RUNTIME = ("hisparse_jax.harness", "hisparse_jax.models", "hisparse_jax.serving",
                 "hisparse_jax.cli", "benchmarks", "bridge", "tests")
# What `pip install hisparse` brings, with the standard library.
CORE = {"jax", "jaxlib", "flax", "numpy", "mmh3"}


def sources(*paths):
    for p in paths:
        p = ROOT / p
        yield from sorted(p.rglob("*.py")) if p.is_dir() else [p]


def imported(path: pathlib.Path) -> set[str]:
    """Every module `path` imports, absolute (relative imports resolved)."""
    names = set()
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def offenders(paths, banned):
    return sorted(f"{p.relative_to(ROOT)}: {n}" for p in sources(*paths)
                  for n in imported(p) if under(n, banned))


def test_kernels_import_nothing_of_the_library():
    assert offenders(["cpu_kernels", "pallas_kernels"], ("hisparse_jax", "bridge")) == []


def test_runtime_wings_import_nothing_above_them():
    assert offenders(RUNTIME, ABOVE_RUNTIME) == []


def test_library_never_imports_the_bridge():
    assert offenders(["hisparse_jax", "cpu_kernels", "pallas_kernels"], ("bridge",)) == []


@pytest.mark.parametrize("package", ["torch", "vllm"])
def test_only_the_bridge_imports(package):
    assert offenders(["hisparse_jax", "cpu_kernels", "pallas_kernels", "benchmarks"],
                     (package,)) == []


def test_the_rules_see_a_violation():
    """The checks above read imports in functions and relative ones too."""
    bad = ROOT / "hisparse_jax" / "cache" / "_architecture_probe.py"
    bad.write_text("def f():\n    from ..harness import workloads\n    import torch\n")
    try:
        found = offenders(RUNTIME, ABOVE_RUNTIME + ("torch",))
    finally:
        bad.unlink()
    assert found == ["hisparse_jax/cache/_architecture_probe.py: hisparse_jax.harness",
                     "hisparse_jax/cache/_architecture_probe.py: hisparse_jax.harness.workloads",
                     "hisparse_jax/cache/_architecture_probe.py: torch"]


def test_runtime_imports_with_the_core_dependencies_alone():
    """Every runtime module imports in a process where only the core dependencies
    (and the standard library) can be imported: the extras are not needed for the
    cache, its attention, offload and capacity."""
    modules = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                     for p in sources(*RUNTIME))
    script = f"""
import importlib.abc, sys
ALLOWED = {sorted(CORE)!r}
OURS = ("hisparse_jax", "cpu_kernels", "pallas_kernels")
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        top = name.split(".")[0]
        if top in ALLOWED or top in OURS or top in sys.stdlib_module_names or top.startswith("_"):
            return None
        # jax and numpy import optional packages of their own: only ours are banned here
        caller = sys._getframe(1)
        while caller and caller.f_globals.get("__name__", "").startswith("importlib"):
            caller = caller.f_back
        who = caller.f_globals.get("__name__", "") if caller else ""
        if who.split(".")[0] in OURS:
            raise ImportError(f"{{who}} imports {{name}}, not a core dependency")
        return None
sys.meta_path.insert(0, Block())
for m in {modules!r}:
    importlib.import_module(m)
print("ok", len({modules!r}))
"""
    r = subprocess.run([sys.executable, "-c", "import importlib\n" + script], cwd=ROOT, check=False,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("ok")


NAMES = "|".join(BACKENDS)
BACKEND_NAME_BRANCH = re.compile(rf"""(==|!=)\s*["']({NAMES})["']|["']({NAMES})["']\s*(==|!=)"""
                                 rf"""|\bin\s*\(\s*["']({NAMES})["']""")


def test_no_branch_on_an_implementation_name_outside_the_registry():
    """Callers ask `hisparse_jax.backends` for an op's implementation: no library
    code compares backend names. (jax's platform names, "cpu" and "gpu", are
    compared on `jax.default_backend()` or a variable named `platform`.)"""
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
             for p in sources("hisparse_jax", "bridge") if p.name != "backends.py"
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if BACKEND_NAME_BRANCH.search(line) and "default_backend()" not in line
             and "platform" not in line]
    assert found == []
