"""torchrun entry of the signal tests: runs pretrain_leviathan.py in this very process (so a
signal sent to "the rank" reaches the real training process) and records how it ended in
$LEVIATHAN_TEST_EXIT_DIR/rank<RANK>: its exit status, or "exception" for an uncaught error.
A rank killed by a signal leaves no file."""

import os
import runpy
import sys
from pathlib import Path

ENTRY = Path(__file__).resolve().parents[2] / "pretrain_leviathan.py"

status = "exception"
try:
    sys.argv = [str(ENTRY), *sys.argv[1:]]
    runpy.run_path(str(ENTRY), run_name="__main__")
    status = "0"
except SystemExit as done:
    status = str(done.code if done.code is not None else 0)
    raise
finally:
    exit_dir = Path(os.environ["LEVIATHAN_TEST_EXIT_DIR"])
    (exit_dir / f"rank{os.environ['RANK']}").write_text(status)
