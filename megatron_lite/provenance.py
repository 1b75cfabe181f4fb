"""Where a run's code came from: the git commit (and whether the tree was dirty).

Logged at start-up and stored in checkpoint metadata; stdlib only, importable by anything.
"""

from __future__ import annotations

import subprocess
from pathlib import Path


def git_commit() -> str:
    """Short commit of the megatron_lite checkout, '-dirty' when it has local changes."""
    here = Path(__file__).parent
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=here, timeout=5, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True,
                               text=True, cwd=here, timeout=5).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
