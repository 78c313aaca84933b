"""Process start-up: CPU seconds of a fresh Python that imports the model and training code.

Two variants, interleaved, each in its own process: `baseline` imports megatron.core first
(its fusions decorate with the real `torch.compile`), `gated` the project's own order
(megatron_ext/megatron_import.py defers them). Prints min and median of --reps pairs and the
ratio gated / baseline. Run: `python benchmarks/bench_startup.py` (about a minute).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `benchmarks.harness` when this file runs as a script

from benchmarks.harness import rounds  # noqa: E402

IMPORTS = (
    "from megatron_ext.models import LeviathanModel, build_model; import megatron_ext.training.run"
)
CHECK = "; import sys; print('torch._inductor.compile_fx' in sys.modules)"
VARIANTS = {"baseline": "import megatron.core; " + IMPORTS + CHECK, "gated": IMPORTS + CHECK}


def child_cpu_seconds(code: str) -> tuple[float, str]:
    """(user + system CPU seconds, stdout) of `python -c code` run from the repository root."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    )
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code],
        cwd=REPO, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, done.stdout.strip().splitlines()[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="interleaved pairs")
    args = parser.parse_args()
    variants = {name: lambda _, c=code: child_cpu_seconds(c) for name, code in VARIANTS.items()}
    runs = rounds(variants, args.reps)
    times = {name: [cpu for cpu, _ in values] for name, values in runs.items()}
    for name, values in times.items():
        print(
            f"{name:9s} CPU s: min {min(values):.2f}  median {statistics.median(values):.2f}  "
            f"(Inductor loaded: {runs[name][-1][1]})"
        )
    base, gated = times["baseline"], times["gated"]
    print(
        f"gated / baseline: min {min(gated) / min(base):.2f}  "
        f"median {statistics.median(gated) / statistics.median(base):.2f}"
    )


if __name__ == "__main__":
    main()
