"""``python -m jremat``: the installed version, and where the command-line tools are."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from jremat._version import __version__

TOOLS = (
    ("jremat-ptb", "jremat.train.ptb", "train the reference LM on Penn Treebank"),
    ("jremat-memory", "jremat.train.memory", "compiled memory per policy"),
    ("jremat-bench", "jremat.train.bench", "every policy and its peers side by side"),
    ("jremat-launch", "jremat.train.launch", "several processes on one machine"),
)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the version (``--version``) or the list of command-line tools; returns the exit code."""
    epilog = "command-line tools (need the [train] extra):\n" + "\n".join(
        f"  {script:<15} python -m {module:<22} {what}" for script, module, what in TOOLS
    )
    parser = argparse.ArgumentParser(
        prog="python -m jremat",
        description="jremat: activation rematerialization for JAX with fine-grained policies.",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"jremat {__version__}")
    parser.parse_args(argv)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
