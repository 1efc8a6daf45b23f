"""What another local user sees of this machine's processes: every command line (/proc/<pid>/cmdline is
world-readable) and whether it can read given processes' environments (their owner's alone).

The scan runs as `nobody` when the tests run as root (`setpriv`), else as the test's own user, which sees
the same command lines. The secrets it looks for reach it on stdin, never on its own command line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

NOBODY = 65534

_SCAN = """
import json, sys
from pathlib import Path
given = json.load(sys.stdin)
wanted = [s.encode() for s in given["secrets"]]
leaks, seen = [], []
for entry in Path("/proc").iterdir():
    if not entry.name.isdigit():
        continue
    try:
        line = (entry / "cmdline").read_bytes()
    except OSError:  # exited meanwhile
        continue
    seen.append(line.replace(b"\\0", b" ").decode(errors="replace"))
    leaks += [seen[-1] for s in wanted if s in line]
readable = []
for pid in given["environ_pids"]:
    try:
        (Path("/proc") / str(pid) / "environ").read_bytes()
        readable.append(pid)
    except OSError:
        pass
print(json.dumps({"leaks": leaks, "command_lines": seen, "environ_readable": readable}))
"""


@dataclass(frozen=True)
class Scan:
    leaks: list[str]  # command lines holding a secret
    command_lines: list[str]  # every process's, arguments joined by spaces
    environ_readable: list[int]  # of the pids asked about, those whose environment the scan read
    as_another_user: bool


def another_user() -> list[str]:
    """A command prefix that runs as `nobody` where the tests can switch users, else nothing."""
    setpriv = shutil.which("setpriv")
    if os.geteuid() == 0 and setpriv:
        return [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    return []


def scan(secrets: Sequence[str], environ_pids: Sequence[int] = ()) -> Scan:
    prefix = another_user()
    given = json.dumps({"secrets": list(secrets), "environ_pids": list(environ_pids)})
    done = subprocess.run(
        [*prefix, sys.executable, "-c", _SCAN], input=given, capture_output=True, text=True, check=True
    )
    return Scan(**json.loads(done.stdout), as_another_user=bool(prefix))
