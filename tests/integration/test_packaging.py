"""The distribution: what `pip install <repo>` puts into site-packages."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_wheel_ships_leadgate_and_the_three_top_level_folders_only(tmp_path: Path) -> None:
    # Built from a copy: setuptools builds in the source tree, leaving build/ and
    # *.egg-info there, and a later build ships whatever build/lib still holds (a module
    # or package since removed from the repository), and two runs of the suite in one
    # checkout would build in the same folder at once.
    source = tmp_path / "source"
    shutil.copytree(
        REPO,
        source,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "*.egg-info", "node_modules", "__pycache__", ".*_cache"
        ),
    )
    out = tmp_path / "wheel"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(source)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    [wheel] = out.glob("leadgate-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    # Any other top-level name (engine, web, review, migrations...) could shadow or be
    # shadowed by another distribution's package.
    assert tops == {"leadgate", "bots", "outbox", "binding"}
    # Migrations and the console's files ship inside the package (found with
    # importlib.resources, so an installed wheel works outside the repository).
    assert "leadgate/database/migrations/env.py" in names
    assert any(n.startswith("leadgate/database/migrations/versions/0001_") for n in names)
    assert {"leadgate/web/static/console.html", "leadgate/web/static/console.js"} <= set(names)
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "leadgate = leadgate.cli.main:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
