"""The import contract (``[tool.importlinter]`` in pyproject.toml): folders import one way.

import-linter finds a package's modules by walking its directory, but zserve's folders are
mapped into the ``zserve`` package by setuptools' package-dir (the design card fixes them at the
top level). The test therefore copies them into the layout they have once installed and runs
``lint-imports`` there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUBPACKAGES = ("transport", "scheduler", "backends", "loadgen")


def test_import_layers(tmp_path: Path) -> None:
    package = tmp_path / "zserve"
    shutil.copytree(ROOT / "zserve", package, ignore=shutil.ignore_patterns("__pycache__"))
    for name in SUBPACKAGES:
        shutil.copytree(ROOT / name, package / name, ignore=shutil.ignore_patterns("__pycache__"))
    lint_imports = Path(sys.executable).with_name("lint-imports")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run(
        [str(lint_imports), str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
