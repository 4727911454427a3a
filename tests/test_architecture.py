"""The layering the code promises: settings read in one place and passed down, one direction of imports with no
cycle, states and requests as types, the engine blind to where pipelines run."""
import ast
import dataclasses
import json
import subprocess
import sys
import typing
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "acceldemo"


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(tree: ast.AST) -> set[ast.AST]:
    """Import statements under `if TYPE_CHECKING:` (names for annotations, never imported at run time)."""
    return {node for block in ast.walk(tree) if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
            for statement in block.body for node in ast.walk(statement)}


def package_imports(type_checking: bool = False) -> dict[str, set[str]]:
    """Every module of the package and the package modules it imports, at the top or inside a function alike (and
    under `if TYPE_CHECKING:` with `type_checking`)."""
    modules = {_module(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        skipped = set() if type_checking else _type_checking_only(tree)
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found = set()
        for node in ast.walk(tree):
            if node in skipped:
                continue
            if isinstance(node, ast.ImportFrom):
                base = [*(package[:len(package) - node.level + 1] if node.level else []),
                        *(node.module.split(".") if node.module else [])]
                targets = [(".".join([*base, alias.name]), ".".join(base)) for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [(alias.name, alias.name) for alias in node.names]
            else:
                continue
            for exact, parent in targets:
                target = exact if exact in modules else parent if parent in modules else None
                if target and target != name:
                    found.add(target)
        graph[name] = found
    return graph


def test_no_import_cycle_anywhere_in_the_package():
    graph = package_imports()
    cycles, done = [], set()

    def visit(module: str, path: list[str]) -> None:
        for imported in sorted(graph[module]):
            if imported in path:
                cycles.append(" -> ".join(path[path.index(imported):] + [imported]))
            elif imported not in done:
                visit(imported, path + [imported])
        done.add(module)

    for module in sorted(graph):
        visit(module, [module])
    assert cycles == []


def test_config_records_and_errors_are_the_floor_and_config_is_below_hardware():
    graph = package_imports()
    assert graph["acceldemo.config"] == set()
    assert graph["acceldemo.errors"] == set()
    assert graph["acceldemo.records"] == set()  # the model spec it names is a type only
    assert "acceldemo.config" in graph["acceldemo.hardware.base"]


def test_importing_the_package_changes_nothing_in_the_environment():
    code = ("import json, os; before = dict(os.environ); import acceldemo, acceldemo.ui.server, acceldemo.cli; "
            "import sys; print(json.dumps([{k: v for k, v in os.environ.items() if before.get(k) != v}, "
            "'torch' in sys.modules]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    # Nothing written, and torch not even loaded: an entry point can still prepare the process before it loads.
    assert json.loads(done.stdout.splitlines()[-1]) == [{}, False]


def test_no_module_keeps_process_wide_settings():
    # Settings are built once by an entry point and passed down: no module-level `global` rebinding anywhere.
    found = [f"{path.relative_to(PACKAGE)}:{node.lineno}" for path in PACKAGE.rglob("*.py")
             for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Global)]
    assert found == []
    import acceldemo.config

    assert not hasattr(acceldemo.config, "settings") and not hasattr(acceldemo.config, "use")


_NAMED = ("phase", "state", "mode", "placement", "kind", "outcome", "method", "edits")


def test_phases_states_and_names_are_compared_as_their_enums_never_as_strings():
    def strings(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant):
            return isinstance(node.value, str)
        return isinstance(node, ast.Tuple | ast.List | ast.Set) and any(strings(e) for e in node.elts)

    def named(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr in _NAMED) or \
            (isinstance(node, ast.Name) and node.id in _NAMED)

    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if any(named(side) for side in sides) and any(strings(side) for side in sides):
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {ast.unparse(node)}")
    assert found == []


def test_the_request_executors_see_is_fully_typed():
    from acceldemo.models.catalog import ModelSpec
    from acceldemo.records import PipelineKey, Progress, Request

    for record in (Request, PipelineKey, Progress):
        hints = typing.get_type_hints(record, localns={"ModelSpec": ModelSpec})  # a name records imports for types
        loose = {field.name: hints[field.name] for field in dataclasses.fields(record)
                 if hints[field.name] in (typing.Any, object)}
        assert loose == {}, record
        assert record.__dataclass_params__.frozen, record


def _environment_reads(tree: ast.AST) -> list[str]:
    """ACCELDEMO_* names read from the environment: os.environ[...], os.environ.get/pop(...), os.getenv(...)
    (setting one for a child process is not a read)."""
    found = []
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and ast.unparse(node.value) == "os.environ":
            name = node.slice
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("os.environ.get", "os.environ.pop",
                                                                       "os.getenv", "os.environ.setdefault"):
            name = node.args[0] if node.args else None
        if isinstance(name, ast.Constant) and str(name.value).startswith("ACCELDEMO_"):
            found.append(name.value)
        elif isinstance(name, ast.JoinedStr) and ast.unparse(name).startswith("f'ACCELDEMO_"):
            found.append(ast.unparse(name))
    return found


def test_acceldemo_variables_are_read_only_in_config():
    reads = {str(path.relative_to(PACKAGE)): _environment_reads(ast.parse(path.read_text()))
             for path in PACKAGE.rglob("*.py")}
    assert {path: names for path, names in reads.items() if names and path != "config.py"} == {}
    assert len(reads["config.py"]) == 0  # config reads through its own helpers, never the names one by one
    assert "ACCELDEMO_QUEUE_SIZE" in (PACKAGE / "config.py").read_text()


def test_the_engine_never_imports_the_worker_pool():
    code = ("import json, sys, acceldemo.engine; "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('acceldemo.executors'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = json.loads(done.stdout)
    assert "acceldemo.executors.pool" not in loaded and "acceldemo.executors.worker" not in loaded, loaded
    for path in (PACKAGE / "engine").glob("*.py"):
        assert "executors.pool" not in path.read_text() and "executors.routing" not in path.read_text(), path


def test_lower_layers_never_import_upper_ones():
    # hardware and models know nothing of the engine, the executors or the front ends; the engine nothing of
    # the front ends.
    upper = {"hardware": ("engine", "executors", "builder", "fleet", "ui", "cli", "bench"),
             "models": ("engine", "executors", "builder", "fleet", "ui", "cli", "bench"),
             "executors": ("engine", "builder", "fleet", "ui", "cli", "bench"),
             "engine": ("builder", "fleet", "ui", "cli", "bench"),
             "fleet": ("ui", "cli", "bench")}
    wrong = []
    for layer, forbidden in upper.items():
        for path in (PACKAGE / layer).rglob("*.py"):
            package = path.relative_to(PACKAGE.parent).parent.parts  # e.g. ("acceldemo", "models", "shapes")
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.level:
                    target = (*package[:len(package) - node.level + 1], *(node.module or "").split("."))
                elif isinstance(node, ast.ImportFrom | ast.Import):
                    target = tuple((node.module if isinstance(node, ast.ImportFrom) else node.names[0].name)
                                   .split("."))
                else:
                    continue
                if target[0] == "acceldemo" and len(target) > 1 and target[1] in forbidden:
                    wrong.append(f"{path.relative_to(PACKAGE)} imports {'.'.join(target)}")
    assert wrong == []


def test_nothing_in_the_runtime_package_imports_the_training_code():
    # training/ builds and scores the embedded models from the runtime; the app must run without it.
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                modules = [node.module]
            else:
                continue
            wrong += [f"{path.relative_to(PACKAGE)} imports {module}" for module in modules
                      if module.split(".")[0] == "training"]
    assert wrong == []
    moved = ("train.py", "dataset.py", "evaluate.py", "judge.py", "architecture.py")
    assert [name for name in moved if (PACKAGE / "models" / "shapes" / name).exists()] == []


def _package_trees():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE), ast.parse(path.read_text())


def test_no_function_is_longer_than_80_lines():
    long = [f"{path}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path, tree in _package_trees() for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno >= 80]
    assert long == []


def test_nothing_dispatches_on_a_class_name():
    # What a pipeline or scheduler is comes from the catalog (`PipelineFamily`) or isinstance, never from
    # `type(x).__name__` compared or looked up (naming a type in a message is fine).
    def class_name(node: ast.AST) -> bool:
        return any(isinstance(n, ast.Attribute) and n.attr == "__name__" and isinstance(n.value, ast.Call)
                   and ast.unparse(n.value.func) == "type" for n in ast.walk(node))

    found = []
    for path, tree in _package_trees():
        for node in ast.walk(tree):
            compared = isinstance(node, ast.Compare) and class_name(node)
            looked_up = isinstance(node, ast.Subscript) and class_name(node.slice)
            got = isinstance(node, ast.Call) and ast.unparse(node.func).endswith(".get") and \
                bool(node.args) and class_name(node.args[0])
            if compared or looked_up or got:
                found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    assert found == []


def test_no_state_of_ours_is_set_on_another_librarys_objects():
    # What the product adds to a diffusers pipeline lives in `executors.prepared.PreparedPipeline`, not in
    # attributes patched onto the pipeline. compat.py holds the version-guarded library shims, each with its end.
    found = []
    for path, tree in _package_trees():
        if path.name == "compat.py":
            continue
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, ast.AugAssign | ast.AnnAssign) else []
            found += [f"{path}:{node.lineno}: {ast.unparse(t)}" for t in targets
                      if isinstance(t, ast.Attribute) and t.attr.startswith("_acceldemo")]
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "setattr":
                found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("_acceldemo"):
                found.append(f"{path}:{node.lineno}: {node.value!r}")
    assert found == []


def test_no_import_cycle_even_for_type_checking():
    # The names imported for annotations only count too: a loop there is still two modules that need each other.
    graph = package_imports(type_checking=True)
    cycles = []

    def visit(module: str, path: list[str], done: set) -> None:
        for imported in sorted(graph[module]):
            if imported in path:
                cycles.append(" -> ".join(path[path.index(imported):] + [imported]))
            elif imported not in done:
                visit(imported, path + [imported], done)
        done.add(module)

    done: set = set()
    for module in sorted(graph):
        visit(module, [module], done)
    assert cycles == []
