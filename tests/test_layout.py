"""The library (what ``import tetris_hf`` and ``custom_generate="tetris"`` run) never imports a tool
(``tetris_hf.tools``: the commands, model and data loading, the Hub export), neither at import time nor inside a
function."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "tetris_hf"
TOOLS = "tetris_hf.tools"


def module_name(path: Path) -> str:
    """``tetris_hf/logits/verification.py`` -> ``tetris_hf.logits.verification`` (an ``__init__`` is its package)."""
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, name: str, is_package: bool) -> list[tuple[int, str]]:
    """``(line, absolute module)`` of every import statement in ``source``, wherever it sits (module level, function,
    branch), relative imports resolved against module ``name``; ``from X import y`` yields both ``X`` and ``X.y``
    (``y`` may be a submodule)."""
    package = name if is_package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def tool_imports(path: Path) -> list[str]:
    """``"file:line imports module"`` for every import of a tool module in the library file at ``path``."""
    name = module_name(path)
    imports = imported_modules(path.read_text(), name, path.name == "__init__.py")
    return [f"{path.relative_to(PACKAGE_DIR.parent)}:{line} imports {module}" for line, module in imports
            if module == TOOLS or module.startswith(TOOLS + ".")]


def library_files() -> list[Path]:
    """Every module of the package outside ``tools/``."""
    return sorted(path for path in PACKAGE_DIR.rglob("*.py") if path.relative_to(PACKAGE_DIR).parts[0] != "tools")


def test_importing_the_package_loads_no_tool_module():
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, tetris_hf; print('\\n'.join(m for m in sys.modules if "
                               "m.startswith('tetris_hf')))"],
        capture_output=True, text=True, check=True).stdout.split()
    assert "tetris_hf.generation" in loaded and "tetris_hf.decoding" in loaded
    assert [name for name in loaded if name.startswith(TOOLS)] == []


def test_no_library_module_imports_a_tool_anywhere_in_its_source():
    files = library_files()
    assert {"decoding.py", "kv.py", "verification.py", "batched_draft.py", "batch.py"} <= {p.name for p in files}
    offending = [hit for path in files for hit in tool_imports(path)]
    assert offending == []


@pytest.mark.parametrize("source", [
    "from .tools.models import cache_dir\n",
    "def f():\n    from .tools import models\n",
    "def f():\n    if True:\n        import tetris_hf.tools.data\n",
    "from tetris_hf.tools.cli import main\n",
])
def test_the_check_sees_tool_imports_at_any_depth(tmp_path, source, monkeypatch):
    fake_package = tmp_path / "tetris_hf"
    fake_package.mkdir()
    module = fake_package / "cost_model.py"
    module.write_text(source)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE_DIR", fake_package)
    assert len(tool_imports(module)) >= 1


def test_the_check_lets_library_imports_through(tmp_path, monkeypatch):
    fake_package = tmp_path / "tetris_hf"
    (fake_package / "logits").mkdir(parents=True)
    module = fake_package / "logits" / "verification.py"
    module.write_text("from ..kv import SlotCache\nfrom . import processing\nimport torch\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE_DIR", fake_package)
    assert tool_imports(module) == []
    assert [m for _, m in imported_modules(module.read_text(), "tetris_hf.logits.verification", False)][:2] == [
        "tetris_hf.kv", "tetris_hf.kv.SlotCache"]


def import_graph(files: list[Path]) -> dict[str, set[str]]:
    """Library module -> the library modules it imports, anywhere in its source (type-checking blocks included)."""
    names = {module_name(path) for path in files}
    graph = {}
    for path in files:
        name = module_name(path)
        imports = imported_modules(path.read_text(), name, path.name == "__init__.py")
        graph[name] = {module for _, module in imports if module in names and module != name}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every circle a depth-first walk of ``graph`` meets, as the modules along it."""
    state, path, circles = {}, [], []

    def visit(module: str) -> None:
        state[module] = "open"
        path.append(module)
        for imported in sorted(graph[module]):
            if state.get(imported) == "open":
                circles.append(path[path.index(imported):] + [imported])
            elif imported not in state:
                visit(imported)
        path.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return circles


def test_no_library_module_imports_one_that_imports_it_back():
    assert import_circles(import_graph(library_files())) == []


def test_the_circle_check_finds_a_circle_through_a_function_level_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_circles(graph) == [["a", "b", "c", "a"]]
    assert import_circles({"a": {"b"}, "b": set()}) == []


def test_the_drafter_protocol_has_at_most_seven_methods():
    """The loop asks a drafter for six things (prefill, propose, accept, settle, join, catch_up); what it needs on the
    host comes back in tensors the loop reads, not through methods of their own."""
    import inspect

    from tetris_hf.candidate_generators.drafter import Drafter
    from tetris_hf.candidate_generators.transformers_api import CandidateGeneratorAPI

    own = [name for name, member in vars(Drafter).items()
           if inspect.isfunction(member) and not name.startswith("_")]
    assert sorted(own) == ["accept", "catch_up", "join", "prefill", "propose", "settle"]
    assert not set(own) & set(vars(CandidateGeneratorAPI))
