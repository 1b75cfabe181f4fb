"""tests/readme_help.py, the forked runner of the README's `python ... --help` forms: a child
sees what a fresh interpreter would, and a flag the script lacks fails though --help is given."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

RUNNER = Path(__file__).resolve().parent / "readme_help.py"
SCRIPT = """import argparse
p = argparse.ArgumentParser()
p.add_argument("--steps", type=int)
p.parse_args()
print("ran", __file__)
"""


@pytest.mark.quick
def test_forked_commands_run_like_fresh_interpreters(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "x.py").write_text(SCRIPT)
    (tmp_path / "sub" / "needs_cwd.py").write_text("import here\n")
    (tmp_path / "here.py").write_text("import sys\nsys.exit(3)\n")
    commands = [["python", "sub/x.py", "--steps", "3", "--help"],
                ["python", "sub/x.py", "--bogus", "--help"],  # argparse alone: exit 0
                ["python", "sub/x.py", "--steps", "2"],
                ["python", "sub/needs_cwd.py"],  # the cwd is not on a script's sys.path
                ["python", "-m", "here"]]  # but it is on a module's
    proc = subprocess.run([sys.executable, str(RUNNER), "", json.dumps(commands)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60, check=True)
    (help_code, help_out), (bogus_code, bogus_out), (ran_code, ran_out), (cwd_code, cwd_out), \
        (module_code, _) = json.loads(proc.stdout)
    assert help_code == 0 and "usage: x.py [-h] [--steps STEPS]" in help_out
    assert bogus_code == 2 and "unrecognized arguments: --bogus" in bogus_out
    assert ran_code == 0 and f"ran {tmp_path / 'sub' / 'x.py'}" in ran_out
    assert cwd_code == 1 and "No module named 'here'" in cwd_out
    assert module_code == 3
