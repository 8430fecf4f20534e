"""The distribution: what `pip install <repo>` puts into site-packages."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_wheel_ships_leadgate_and_the_three_top_level_folders_only(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(REPO)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    [wheel] = tmp_path.glob("leadgate-*.whl")
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
