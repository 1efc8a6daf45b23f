"""Files that hold secrets (keys, passwords, tokens) and directories of them: their owner's alone.

Secrets reach the processes of the local stack through such files or the environment, never the command
line: any local user reads every process's command line (`ps`, /proc/<pid>/cmdline), while a process's
environment and a 0600 file are its owner's alone.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

from specserve.errors import InvalidArgument

PRIVATE_MODE = 0o600
PRIVATE_DIRECTORY_MODE = 0o700


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


def private_directory(path: Path) -> Path:
    """`path` as a directory only its owner can list or enter (0700): made so, or, if it exists and is
    ours, narrowed to that whatever its mode was. One another user owns is refused: its owner could read
    whatever went in it, and only they can change that."""
    path.mkdir(mode=PRIVATE_DIRECTORY_MODE, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.geteuid():
        raise InvalidArgument(
            f"{path} is owned by another user (uid {info.st_uid}): use a directory of your own"
        )
    os.chmod(path, PRIVATE_DIRECTORY_MODE)
    return path


def open_private_append(path: Path) -> BinaryIO:
    """`path` opened to append (a log), mode 0600 as `write_private` gives, also if it existed with a
    wider mode. Refuses to follow a symlink."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, PRIVATE_MODE)
    try:
        os.fchmod(fd, PRIVATE_MODE)
    except OSError:
        os.close(fd)
        raise
    return os.fdopen(fd, "ab")
