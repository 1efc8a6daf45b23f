"""Files that hold secrets (keys, passwords, tokens): readable by their owner alone.

Secrets reach the processes of the local stack through such files or the environment, never the command
line: any local user reads every process's command line (`ps`, /proc/<pid>/cmdline), while a process's
environment and a 0600 file are its owner's alone.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

PRIVATE_MODE = 0o600


def write_private(path: Path, data: str | bytes) -> Path:
    """Writes `data` to `path` with mode 0600 from the first byte on (no window in which the umask's
    mode applies), also when the file existed with a wider mode. Refuses to follow a symlink."""
    content = data.encode() if isinstance(data, str) else data
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, PRIVATE_MODE)
    try:
        os.fchmod(fd, PRIVATE_MODE)
        with os.fdopen(fd, "wb", closefd=False) as out:
            out.write(content)
    finally:
        os.close(fd)
    return path


def readable_by_others(path: Path) -> bool:
    """Whether the file's group or other users may read it."""
    return bool(path.stat().st_mode & (stat.S_IRGRP | stat.S_IROTH))
