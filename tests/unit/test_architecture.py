"""docs/architecture.md's module map is the tree: a module added, moved or removed without the map fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("gateway", "isolation")
# A map line: its indent (two spaces a level), then a module or a package (a name ending in "/").
ENTRY = re.compile(r"^( *)([a-z_]+(?:\.py|/))(?:\s|$)")


def mapped() -> set[str]:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = text.split("## Modules", 1)[1].split("```", 2)[1]
    found: set[str] = set()
    parents: list[str] = []
    for line in block.splitlines():
        match = ENTRY.match(line)
        if match is None:
            continue
        depth, name = len(match.group(1)) // 2, match.group(2)
        parents = parents[:depth]
        path = "/".join([*parents, name])
        if name.endswith("/"):
            parents.append(name.rstrip("/"))
            found.add(path.rstrip("/"))
        else:
            found.add(path)
    return found


def tree() -> set[str]:
    found: set[str] = set()
    for package in PACKAGES:
        found.add(package)
        for path in (ROOT / package).rglob("*"):
            relative = path.relative_to(ROOT)
            # isolation's audit/ and sim/ are mapped as whole packages, gateway's packages module by module.
            if package == "isolation" and len(relative.parts) > 2:
                continue
            if path.is_dir() and (path / "__init__.py").exists():
                found.add(relative.as_posix())
            elif path.suffix == ".py" and path.name != "__init__.py":
                found.add(relative.as_posix())
    return found


def test_the_module_map_names_every_module_and_no_other() -> None:
    on_disk, in_map = tree(), mapped()
    assert not on_disk - in_map, f"modules missing from docs/architecture.md's map: {sorted(on_disk - in_map)}"
    assert not in_map - on_disk, f"docs/architecture.md maps modules that do not exist: {sorted(in_map - on_disk)}"
