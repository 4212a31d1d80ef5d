"""The package's shape: folders are stages, imports point one way (bottom to top), no import cycle, and an import of a
slimroute module inside a function only where a heavy optional dependency stands behind it (marked `# lazy: why`)."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
# Bottom to top: a module imports modules of its own stage or of a lower one, never of a higher one.
STAGES = (
    ("vocabulary", ("slimroute.labels", "slimroute.task", "slimroute.config")),
    ("runtime", ("slimroute.runtime",)),
    ("io", ("slimroute.io",)),
    ("accuracy", ("slimroute.accuracy",)),
    ("engine", ("slimroute.engine",)),
    ("backends", ("slimroute.backends",)),
    ("router", ("slimroute.router",)),
    ("integrations", ("slimroute.estimator", "slimroute.bench")),
    ("server", ("slimroute.server",)),
    ("cli", ("slimroute.cli",)),
    ("public face", ("slimroute",)),  # slimroute/__init__.py
)
MAX_LAZY_IMPORTS = 24


def module_names() -> dict[str, Path]:
    names = {}
    for path in (SRC / "slimroute").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """(imported slimroute module, line, inside a function) for each import in the module's source."""
    found = []
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((alias.name, child.lineno, in_function) for alias in child.names
                             if alias.name.split(".")[0] == "slimroute")
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - child.level + 1] + [base]).strip(".")
                if base.split(".")[0] == "slimroute":
                    for alias in child.names:  # `from pkg import module` imports the module
                        target = f"{base}.{alias.name}"
                        found.append((target if target in modules else base, child.lineno, in_function))
            visit(child, inside)

    visit(ast.parse(path.read_text()), False)
    return found


def stage(name: str) -> int:
    best = None
    for rank, (_, prefixes) in enumerate(STAGES):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and (best is None or len(prefix) > best[1]):
                best = (rank, len(prefix))
    assert best is not None, f"{name} belongs to no stage: add it to STAGES"
    return best[0]


@pytest.fixture(scope="module")
def graph():
    modules = module_names()
    return modules, {name: imports(name, path, modules) for name, path in modules.items()}


def test_no_module_imports_from_a_higher_stage(graph):
    _, edges = graph
    upward = [f"{name} (stage {STAGES[stage(name)][0]}) imports {target} (stage {STAGES[stage(target)][0]}), line "
              f"{line}" for name, found in edges.items() for target, line, _ in found if stage(target) > stage(name)]
    assert not upward, "\n".join(upward)


def find_cycle(successors: dict[str, list[str]]) -> list[str] | None:
    """A cycle of the graph (its modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(name: str) -> list[str] | None:
        state[name] = 1
        path.append(name)
        for nxt in successors.get(name, ()):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := walk(nxt)):
                return cycle
        path.pop()
        state[name] = 2
        return None

    for name in sorted(successors):
        if name not in state and (cycle := walk(name)):
            return cycle
    return None


def test_no_import_cycle_counting_the_imports_inside_functions(graph):
    _, edges = graph
    successors = {name: sorted({target for target, _, _ in found if target != name}) for name, found in edges.items()}
    cycle = find_cycle(successors)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_imports_inside_functions_are_few_and_say_why(graph):
    modules, edges = graph
    lazy = [(name, line) for name, found in edges.items() for _, line, inside in found if inside]
    unexplained = [f"{name}:{line}" for name, line in lazy
                   if "# lazy" not in modules[name].read_text().splitlines()[line - 1]]
    assert not unexplained, "an import inside a function needs a '# lazy: reason' comment: " + ", ".join(unexplained)
    assert len(lazy) <= MAX_LAZY_IMPORTS, f"{len(lazy)} imports inside functions; import at the module's top"


def test_the_checks_see_an_upward_import_and_a_cycle():
    """The checks above on made-up graphs: they must be able to fail."""
    assert stage("slimroute.engine.fast") > stage("slimroute.runtime.int8")
    assert stage("slimroute.cli.classify") > stage("slimroute.router") > stage("slimroute.backends.local")
    assert find_cycle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": ["b", "c"], "b": ["c"], "c": []}) is None
    with pytest.raises(AssertionError):
        stage("elsewhere.module")
