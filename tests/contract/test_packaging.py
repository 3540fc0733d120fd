"""What an install carries: the license it declares, the marker that it is typed, and an
import that works from the repository root whichever way remat was installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def test_the_declared_license_is_the_license_file_s() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == {"text": "BSD-3-Clause"}
    assert (ROOT / "LICENSE").read_text().startswith("BSD 3-Clause License")
    assert "License :: OSI Approved :: BSD License" in project["classifiers"]


def test_the_package_says_it_is_typed() -> None:
    assert (ROOT / "remat" / "py.typed").is_file()
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "py.typed" in setuptools["package-data"]["remat"]


def test_remat_imports_from_the_repository_root_without_its_editable_install() -> None:
    """Python started in the repository finds the checkout's remat/ first; with remat
    installed normally (no editable install's finder mapping remat.policies to policies/),
    the checkout must still import, policies included."""
    code = (
        "import sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f) + getattr(f, '__module__', '')]\n"
        "sys.path_importer_cache.clear()\n"
        "import remat\n"
        "assert remat.__file__.startswith(sys.argv[1]), remat.__file__\n"
        "from remat import policies\n"
        "from remat.policies import dots_saveable\n"
        "assert policies.dots_saveable is dots_saveable and remat.policies is policies\n"
        "print(dots_saveable)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(ROOT)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "dots_saveable", proc.stderr
