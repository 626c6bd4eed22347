"""Files the CLIs replace whole (the bench's CSV and report, a resumed metrics file): written in one step."""

from __future__ import annotations

import contextlib
import os
import secrets
import stat


def write_text_atomically(path: str | os.PathLike, text: str) -> None:
    """Replace ``path`` with ``text`` in one step: an interrupted write leaves the old file whole.

    The text is written to a new file beside ``path``, which then replaces it. The file keeps the
    permissions of the one it replaces; a new file gets the usual ones (``0o666`` less the umask),
    as ``open(path, "w")`` gives. Newlines are written as they are in ``text``.

    Raises:
      OSError: if the folder is not writable (nothing is left behind then).
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        mode = None
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as for open(path, "w")
    try:
        with os.fdopen(fd, "w", newline="") as handle:
            handle.write(text)
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


__all__ = ["write_text_atomically"]
