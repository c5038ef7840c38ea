"""Static checks that run with the suite: the import layers, mypy --strict, function length.

zserve's five folders are mapped into the ``zserve`` package by setuptools' package-dir (the
design card fixes them at the top level), which neither import-linter nor mypy can see: run over
the folders themselves, every ``from zserve.transport ...`` import would be unresolved. The
module-scoped ``installed_layout`` fixture therefore builds the installed layout out of symlinks
(``<tmp>/zserve/cli.py -> zserve/cli.py``, ``<tmp>/zserve/transport -> transport/``, ...), and
both tools run against it; mypy's paths are mapped back to the repository's in its report.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
SUBPACKAGES = ("transport", "scheduler", "backends", "loadgen")
FOLDERS = ("zserve", *SUBPACKAGES)
MAX_FUNCTION_LINES = 60
# Cold mypy over the package and the tests takes ~15 s alone on 2 cores; leave room for a busy CI.
MYPY_TIMEOUT_S = 240
LINT_IMPORTS_TIMEOUT_S = 60

_ERROR_LINE = re.compile(r"^(?P<path>[^:\s]+\.py):(?P<line>\d+): error: (?P<message>.*)$")


@pytest.fixture(scope="module")
def installed_layout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding ``zserve/`` as it is once installed, made of symlinks to the tree."""
    root = tmp_path_factory.mktemp("layout")
    package = root / "zserve"
    package.mkdir()
    for source in sorted((ROOT / "zserve").iterdir()):
        if source.name != "__pycache__":
            (package / source.name).symlink_to(source)
    for name in SUBPACKAGES:
        (package / name).symlink_to(ROOT / name, target_is_directory=True)
    return root


def test_import_layers(installed_layout: Path) -> None:
    """The contract in ``[tool.importlinter]``: folders import in one direction."""
    lint_imports = Path(sys.executable).with_name("lint-imports")
    env = {**os.environ, "PYTHONPATH": str(installed_layout)}
    result = subprocess.run(
        [str(lint_imports), str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=installed_layout, env=env, capture_output=True, text=True,
        timeout=LINT_IMPORTS_TIMEOUT_S, check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _repository_path(reported: str, layout: Path) -> str:
    """Map a path mypy reports (in the layout, or in tests/) to the repository's own path."""
    path = Path(reported)
    if not path.is_absolute():
        path = ROOT / path
    package = layout / "zserve"
    if path.is_relative_to(package):
        inner = path.relative_to(package)
        if inner.parts and inner.parts[0] in SUBPACKAGES:
            return inner.as_posix()
        return ("zserve" / inner).as_posix()
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def _mypy_errors(output: str, layout: Path) -> list[str]:
    """mypy's errors as ``path: message  [code]``, paths in the repository, lines dropped."""
    errors = []
    for line in output.splitlines():
        match = _ERROR_LINE.match(line)
        if match:
            path = _repository_path(match["path"], layout)
            errors.append(f"{path}: {match['message']}")
    return errors


def _readable(output: str, layout: Path) -> str:
    """mypy's output with the layout's paths replaced by the repository's (to click through)."""
    lines = []
    for line in output.splitlines():
        match = re.match(r"^(?P<path>[^:\s]+\.py):(?P<line>\d+):", line)
        if match:
            path = _repository_path(match["path"], layout)
            lines.append(f"{path}:{line[match.end('path') + 1:]}")
        else:
            lines.append(line)
    return "\n".join(lines)


def test_types(installed_layout: Path) -> None:
    """``mypy --strict`` over the package (as installed) and the tests, cold cache."""
    # The test folders hold no packages (pytest puts each one on sys.path): each folder is a
    # search root and every module name is unique across them.
    folders = [TESTS, *sorted(path for path in TESTS.iterdir() if path.is_dir()
                              and not path.name.startswith((".", "__")))]
    test_modules = sorted(path.stem for folder in folders for path in folder.glob("*.py"))
    search_path = [str(installed_layout), *map(str, folders)]
    env = {**os.environ, "MYPYPATH": os.pathsep.join(search_path)}
    command = [
        sys.executable, "-m", "mypy", "--strict",
        "--config-file", str(ROOT / "pyproject.toml"),
        "--cache-dir", str(installed_layout / ".mypy_cache"),
        "--show-error-codes", "--no-color-output", "--no-error-summary",
        "-p", "zserve", *[arg for module in test_modules for arg in ("-m", module)],
    ]
    result = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=MYPY_TIMEOUT_S, check=False,
    )
    report = _readable(result.stdout + result.stderr, installed_layout)
    assert result.returncode in (0, 1), report  # 2: mypy itself failed (bad option, crash)
    assert not _mypy_errors(result.stdout, installed_layout), f"mypy --strict errors:\n{report}"


def _long_functions(path: Path) -> Iterator[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            assert node.end_lineno is not None
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                yield f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines"


def test_function_length() -> None:
    """No function or method in the five folders is over ``MAX_FUNCTION_LINES`` (tests exempt)."""
    too_long = [
        finding
        for folder in FOLDERS
        for path in sorted((ROOT / folder).rglob("*.py"))
        for finding in _long_functions(path)
    ]
    assert not too_long, "split these functions:\n" + "\n".join(too_long)


def test_mypy_paths_map_back_to_the_repository(installed_layout: Path) -> None:
    """Errors found through the layout's symlinks are reported at the repository's paths."""
    package = installed_layout / "zserve"
    assert _repository_path(str(package / "transport" / "codec.py"), installed_layout) == (
        "transport/codec.py"
    )
    assert _repository_path(str(package / "cli.py"), installed_layout) == "zserve/cli.py"
    assert _repository_path("tests/conftest.py", installed_layout) == "tests/conftest.py"
    output = f"{package / 'loadgen' / 'bench' / 'echo.py'}:7: error: Bad  [misc]\n"
    assert _mypy_errors(output, installed_layout) == ["loadgen/bench/echo.py: Bad  [misc]"]
    assert _readable(output, installed_layout) == "loadgen/bench/echo.py:7: error: Bad  [misc]"
