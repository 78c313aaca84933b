"""torchrun entry of the signal tests: runs the pretrain_leviathan module in this very process (so a
signal sent to "the rank" reaches the real training process) and records how it ended in
$LEVIATHAN_TEST_EXIT_DIR/rank<RANK>: its exit status, or "exception" for an uncaught error.
A rank killed by a signal leaves no file."""

import os
import runpy
from pathlib import Path

status = "exception"
try:
    runpy.run_module("pretrain_leviathan", run_name="__main__", alter_sys=True)
    status = "0"
except SystemExit as done:
    status = str(done.code if done.code is not None else 0)
    raise
finally:
    exit_dir = Path(os.environ["LEVIATHAN_TEST_EXIT_DIR"])
    (exit_dir / f"rank{os.environ['RANK']}").write_text(status)
