"""The package loads against the torch it was built for, and refuses any other
torch with an ImportError that names both versions and the fix."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import hyperparallel
from hyperparallel import _build_info

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_built_against_this_torch():
    assert hyperparallel._C.torch_version().split("+")[0] == torch.__version__.split("+")[0]
    assert _build_info.torch_version.split("+")[0] == torch.__version__.split("+")[0]


def test_pinned_version_is_the_one_in_requirements():
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        pins = [line.strip() for line in f if line.startswith("torch==")]
    assert pins == [f"torch=={_build_info.torch_pinned}"]


def test_another_torch_is_a_clear_import_error(tmp_path):
    # A stand-in torch of another version, first on the path: importing the
    # package must fail in Python, before the extension is loaded.
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text('__version__ = "2.10.0+cpu"\n')
    code = textwrap.dedent(
        """
        import sys
        try:
            import hyperparallel
        except ImportError as e:
            print("IMPORT-ERROR:", e)
            print("C loaded:", "hyperparallel._C" in sys.modules)
        """
    )
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.path.join(ROOT, 'python')}")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "IMPORT-ERROR:" in out.stdout, out.stdout + out.stderr
    assert "2.10.0+cpu" in out.stdout and _build_info.torch_version in out.stdout
    assert f"pip install torch=={_build_info.torch_version.split('+')[0]}" in out.stdout
    assert "C loaded: False" in out.stdout


def test_check_torch_version_accepts_local_builds_of_the_same_release():
    hyperparallel.check_torch_version("2.11.0+cu130", "2.11.0")
    with pytest.raises(ImportError, match="built against torch 2.11.0"):
        hyperparallel.check_torch_version("2.12.0", "2.11.0")


# The package's own source: no file too long to read, no import circle.
PACKAGE = os.path.join(ROOT, "python", "hyperparallel")
MAX_LINES = 700


def _modules():
    """{dotted module name: path} of every .py file of the package (a
    package's __init__.py is the package's own name)."""
    found = {}
    for dirpath, _, files in os.walk(PACKAGE):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            parts = ["hyperparallel"] + os.path.relpath(path, PACKAGE)[:-3].split(os.sep)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def test_no_source_file_is_over_700_lines():
    long = {}
    for module, path in _modules().items():
        with open(path) as f:
            n = sum(1 for _ in f)
        if n > MAX_LINES:
            long[os.path.relpath(path, ROOT)] = n
    assert not long, f"files over {MAX_LINES} lines (split them by job): {long}"


def _imports(module, path, modules):
    """The package's modules that importing `module` runs: every import in
    the file, at the top level or inside a function (a function's import runs
    when it is called, and a circle through it is still a circle), but not
    under ``if TYPE_CHECKING:`` (never run). An import of a.b.c runs the
    packages a.b and a first; those that also hold `module` are already being
    imported and add no edge."""
    import ast

    is_package = os.path.basename(path) == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    with open(path) as f:
        tree = ast.parse(f.read(), path)

    def walk(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                yield from (n for c in child.orelse for n in [c, *walk(c)])
                continue
            yield child
            yield from walk(child)

    targets = set()
    for node in walk(tree):
        if isinstance(node, ast.Import):
            targets.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            targets.add(base)
            # `from x import y`: y may be a submodule of x
            targets.update(f"{base}.{a.name}" for a in node.names)
    mine = set()
    parts = module.split(".")
    for k in range(1, len(parts) + 1):
        mine.add(".".join(parts[:k]))
    out = set()
    for t in targets:
        parts = t.split(".")
        for k in range(1, len(parts) + 1):
            name = ".".join(parts[:k])
            if name in modules and name not in mine:
                out.add(name)
    return out


def _cycle(graph):
    """One import circle of `graph` ({module: set of modules}), or None."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_the_package_has_no_import_circle():
    modules = _modules()
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    assert "hyperparallel.pipeline" in graph["hyperparallel"]  # it sees the imports
    cycle = _cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)
