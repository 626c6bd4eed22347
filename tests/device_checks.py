"""The driver of the suite's multi-device check modules (tests/train/sharded_checks.py,
tests/jremat/mesh_checks.py), which run in a subprocess started with simulated devices."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Mapping


def run_checks(checks: Mapping[str, Callable[[], object]], argv: list[str]) -> int:
    """Run the named checks (default: all) and print their results as one JSON object, with the
    device count and each check's seconds; 2 (and one line on stderr) for an unknown check name."""
    import jax

    names = argv or list(checks)
    unknown = [n for n in names if n not in checks]
    if unknown:
        print(f"unknown check {unknown[0]!r}; valid: {', '.join(checks)}", file=sys.stderr)
        return 2
    result = {"device_count": jax.device_count(), "seconds": {}}
    for name in names:
        start = time.perf_counter()
        result[name] = checks[name]()
        result["seconds"][name] = round(time.perf_counter() - start, 1)
    print(json.dumps(result))
    return 0
