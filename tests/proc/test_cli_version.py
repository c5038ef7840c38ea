"""``zserve --version`` and ``zserve.__version__``: the installed distribution's version."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

import zserve

CLI_TIMEOUT_S = 60


def test_version_is_the_installed_distributions() -> None:
    assert zserve.__version__ == metadata.version("zserve")
    assert zserve.__version__.count(".") >= 2


def test_the_command_prints_its_version() -> None:
    for flag in ("--version", "-V"):
        result = subprocess.run(
            [sys.executable, "-m", "zserve", flag], capture_output=True, text=True,
            timeout=CLI_TIMEOUT_S, check=False,
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout == f"zserve {zserve.__version__}\n"
