"""Running `launch.main` in-process from tests (shared by test_launch and test_launch_generate)."""

from __future__ import annotations

import launch


def run_main(argv: list[str], capsys) -> tuple[int | str | None, str, str]:
    """launch.main's exit code (argparse's SystemExit included) and its (stdout, stderr)."""
    try:
        rc = launch.main(argv)
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err
