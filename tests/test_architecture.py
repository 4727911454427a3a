"""The layering the code promises: settings read in one place, the engine blind to where pipelines run."""
import ast
import json
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "acceldemo"


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
    upper = {"hardware": ("engine", "executors", "ui", "cli", "bench"),
             "models": ("engine", "executors", "ui", "cli", "bench"),
             "executors": ("engine", "ui", "cli", "bench"),
             "engine": ("ui", "cli", "bench")}
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
