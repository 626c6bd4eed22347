"""Check a built wheel and sdist: the wheel installs one top-level name, ``jremat``.

Usage: ``python .ci/wheel_check.py WHEEL SDIST``. Exits 1 naming every offending entry.
"""

from __future__ import annotations

import re
import sys
import tarfile
import zipfile

ALLOWED_TOP = re.compile(r"^(jremat|jremat-[^/]+\.dist-info)$")
#: Packages of the library that must be in the wheel, under jremat/.
REQUIRED = ("jremat/__init__.py", "jremat/policies/__init__.py", "jremat/models/gpt.py", "jremat/train/ptb.py")
#: The checkout folders the sdist must carry to rebuild the wheel.
SDIST_REQUIRED = ("pyproject.toml", "README.md", "jremat/", "policies/", "models/", "train/")


def main(wheel: str, sdist: str) -> int:
    problems = []
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        top = sorted({n.split("/", 1)[0] for n in names})
        problems += [
            f"wheel: top-level entry {t!r} (only jremat and its dist-info may be)"
            for t in top
            if not ALLOWED_TOP.match(t)
        ]
        problems += [f"wheel: {r} missing" for r in REQUIRED if r not in names]
        for meta in (n for n in names if n.endswith(".dist-info/top_level.txt")):
            listed = zf.read(meta).decode().split()
            if listed != ["jremat"]:
                problems.append(f"wheel: {meta} lists {listed}, expected ['jremat']")
        entry_points = next((zf.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt")), "")
        for line in entry_points.splitlines():
            target = line.partition("=")[2].strip()
            if target and not target.startswith("jremat"):
                problems.append(f"wheel: entry point {line.strip()!r} names a module outside jremat")
    with tarfile.open(sdist) as tf:
        members = [m.name.split("/", 1)[1] for m in tf.getmembers() if "/" in m.name]
    for required in SDIST_REQUIRED:
        if not any(m == required.rstrip("/") or m.startswith(required) for m in members):
            problems.append(f"sdist: {required} missing")
    for p in problems:
        print(f"wheel check: {p}", file=sys.stderr)
    if not problems:
        print(f"wheel check: top-level names {top}; {len(names)} files; sdist {len(members)} entries")
    return 1 if problems else 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2]))
