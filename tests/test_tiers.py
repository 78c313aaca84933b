"""The unit tier launches nothing: tests/conftest.py refuses a launch from an unmarked test."""

import multiprocessing
import subprocess
import sys

import pytest


def test_unit_test_cannot_launch_python():
    with pytest.raises(AssertionError, match="belongs to the integration tier"):
        subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_unit_test_cannot_start_a_multiprocessing_child():
    with pytest.raises(AssertionError, match="pytest.mark.integration"):
        multiprocessing.get_context("spawn").Process(target=print).start()


def test_unit_test_may_run_other_programs():
    # Compilers (the C++ LEV kernel's build) and git (run metadata) are not launched runs.
    assert subprocess.run(["true"]).returncode == 0


@pytest.mark.integration
def test_integration_test_may_launch():
    out = subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True)
    assert out.stdout.strip() == "42"
