"""scripts/function_lengths.py: no library function over 60 lines, and the checker finds one that is."""

import subprocess
import sys
from pathlib import Path

from tests.helpers_scripts import SCRIPTS, load_script

REPO = Path(__file__).resolve().parents[1]


def test_no_library_function_is_over_60_lines():
    run = subprocess.run([sys.executable, str(SCRIPTS / "function_lengths.py")], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 function(s) over 60 lines" in run.stdout


def test_the_checker_reports_a_long_function_and_its_nested_name(tmp_path):
    body = "\n".join(f"        x{i} = {i}" for i in range(60))
    (tmp_path / "m.py").write_text(f"class A:\n    def f(self):\n{body}\n\n    def g(self):\n        return 1\n")
    hits = load_script("function_lengths").long_functions(tmp_path, 60)
    assert [(line, name, n) for _, line, name, n in hits] == [(2, "A.f", 61)]
    assert load_script("function_lengths").long_functions(tmp_path, 61) == []
