"""Check a built wheel and sdist: the wheel installs one top-level name, ``jremat``, and carries its
license file and the metadata a package index shows (license, project URLs).

Usage: ``python .ci/wheel_check.py WHEEL SDIST``. Exits 1 naming every offending entry.
"""

from __future__ import annotations

import email.parser
import re
import sys
import tarfile
import zipfile

ALLOWED_TOP = re.compile(r"^(jremat|jremat-[^/]+\.dist-info)$")
#: Packages of the library that must be in the wheel, under jremat/.
#: jremat/py.typed tells type checkers the package has annotations (PEP 561).
REQUIRED = (
    "jremat/__init__.py",
    "jremat/py.typed",
    "jremat/policies/__init__.py",
    "jremat/models/gpt.py",
    "jremat/train/ptb.py",
)
#: The checkout folders the sdist must carry to rebuild the wheel.
SDIST_REQUIRED = ("pyproject.toml", "README.md", "LICENSE", "jremat/", "policies/", "models/", "train/")
#: METADATA fields (name, value) the wheel must have: its license and where the project lives.
METADATA_REQUIRED = (
    ("License-Expression", "Apache-2.0"),
    ("License-File", "LICENSE"),
    ("Project-URL", "Homepage, https://github.com/jremat/jremat"),
    ("Project-URL", "Repository, https://github.com/jremat/jremat"),
    ("Project-URL", "Documentation, https://github.com/jremat/jremat/tree/main/docs"),
    ("Project-URL", "Issues, https://github.com/jremat/jremat/issues"),
)


def metadata_problems(metadata: str) -> list[str]:
    """The fields of :data:`METADATA_REQUIRED` missing from a wheel's METADATA text (its header, before the description)."""
    header = email.parser.HeaderParser().parsestr(metadata)
    return [
        f"wheel: METADATA has no {field}: {value}"
        for field, value in METADATA_REQUIRED
        if value not in (header.get_all(field) or [])
    ]


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
        if not any(re.fullmatch(r"jremat-[^/]+\.dist-info/licenses/LICENSE", n) for n in names):
            problems.append("wheel: no LICENSE under its .dist-info/licenses/")
        metadata = next((zf.read(n).decode() for n in names if n.endswith(".dist-info/METADATA")), "")
        problems += metadata_problems(metadata)
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
