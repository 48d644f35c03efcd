"""hacrl-fed's tools, apart from the federation runtime (:mod:`hacrl_fed`): benchmarks (:mod:`hacrl_tools.bench`),
the prepared GPU check (:mod:`hacrl_tools.gpu_check`) and the local deployment harness
(:mod:`hacrl_tools.deploy_local`).

They import the library; nothing in the library imports them (tests/test_layers.py checks it): only the command
line's ``hacrl-fed bench`` and ``hacrl-fed deploy-local`` load them, lazily. Inputs (configs, results directories)
come from arguments or the working directory, never from where this package is installed.
"""

from pathlib import Path


def code_path() -> str:
    """The folder this package is imported from (a checkout's root, or site-packages): what a tool's child process
    puts first on ``PYTHONPATH`` to import the same ``hacrl_tools`` (and, in a checkout, the same ``hacrl_fed``).
    Only code is found this way; inputs come from arguments or the working directory."""
    return str(Path(__file__).resolve().parent.parent)
