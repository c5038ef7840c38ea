"""The wheel holds every package: pyproject.toml's explicit ``[tool.setuptools] packages`` list
names each folder with an ``__init__.py`` under the five installed folders. An editable install
(the test command's) imports a package the list misses; a wheel (``pip install .``, the
Containerfile's) leaves it out, and the role that imports it fails only in the image."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_in_the_wheel() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    folders = {package: ROOT / folder for package, folder in setuptools["package-dir"].items()}
    found: set[str] = set()
    for package, folder in folders.items():
        for init in folder.rglob("__init__.py"):
            parts = init.parent.relative_to(folder).parts
            found.add(".".join((package, *parts)))
    assert sorted(found - listed) == [], "packages missing from [tool.setuptools] packages"
    assert sorted(listed - found) == [], "listed packages with no folder"
