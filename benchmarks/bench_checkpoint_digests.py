"""What checkpoint digests add to a save: one TP=2 rank's share of the 1.2B model saved by
`save_checkpoint` in three variants, interleaved: `before` (no digests, torch's zip CRC32),
`digests` (the save now) and `no_crc` (neither: isolates the hashing); then the time of
`verify_checkpoint`. About 8 GB of memory and 7.5 GB of disk; `--scale 0.05` is a smoke test.

    python benchmarks/bench_checkpoint_digests.py --dir /path/on/the/checkpoint/disk
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|full scope).*")

from benchmarks.harness import rounds  # noqa: E402
from megatron_ext.checkpoint.digests import verify_checkpoint  # noqa: E402
from megatron_ext.checkpoint.format import TrainState, checkpoint_dir, save_checkpoint  # noqa: E402
from megatron_ext.config.model import MODEL_SIZE_PRESETS  # noqa: E402
from megatron_ext.lev import LEVConfig  # noqa: E402

VOCAB = 200_064  # o200k_base (200,019 ids) padded to a multiple of 128 x TP
TP = 2


def rank_shapes(scale: float) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of TP rank 0's share of the 1.2B LEV model (`scale` < 1 shrinks
    every row count, for a smoke test)."""
    size = MODEL_SIZE_PRESETS["1.2b"]
    d, f, layers = size["hidden_size"], size["ffn_hidden_size"], size["num_layers"]

    def rows(n: int) -> int:
        return max(1, int(n * scale))

    shapes: dict[str, tuple[int, ...]] = {}
    lev = LEVConfig(vocab_size=VOCAB, hidden_size=d)  # the defaults of --embedding-type lev
    shapes["embedding.word_embeddings.lev"] = (rows(lev.num_parameters() // TP),)
    for i in range(layers):
        prefix = f"decoder.layers.{i}"
        shapes[f"{prefix}.self_attention.linear_qkv.weight"] = (rows(3 * d // TP), d)
        shapes[f"{prefix}.self_attention.linear_proj.weight"] = (rows(d), d // TP)
        shapes[f"{prefix}.mlp.linear_fc1.weight"] = (rows(2 * f // TP), d)
        shapes[f"{prefix}.mlp.linear_fc2.weight"] = (rows(d), f // TP)
        shapes[f"{prefix}.input_layernorm.weight"] = (d,)
        shapes[f"{prefix}.pre_mlp_layernorm.weight"] = (d,)
    shapes["decoder.final_layernorm.weight"] = (d,)
    shapes["output_layer.weight"] = (rows(VOCAB // TP), d)
    return shapes


def _model(shapes: dict[str, tuple[int, ...]]) -> torch.nn.Module:
    """Parameters only (what a save reads from the model)."""
    params = {k.replace(".", "_"): torch.empty(v).normal_() for k, v in shapes.items()}
    return torch.nn.ParameterDict(params)


class _Adam:
    """The optimizer interface `save_checkpoint` reads: each parameter's two moments."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.state = {
            p: {
                "exp_avg": torch.empty_like(p).normal_(),
                "exp_avg_sq": torch.empty_like(p).uniform_(),
                "step": torch.tensor(100.0),
            }
            for p in model.parameters()
        }

    def owned_state(self) -> dict:
        return self.state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=6, help="saves of each variant")
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of the state")
    parser.add_argument("--dir", default=None, help="where to save (default: a temporary dir)")
    args = parser.parse_args()

    from megatron_ext.inference.loading import init_inference_parallel

    pg = init_inference_parallel(1, 1)  # a one-rank world: the save's collectives run as-is
    shapes = rank_shapes(args.scale)
    torch.manual_seed(0)
    started = time.time()
    model = _model(shapes)
    optimizer = _Adam(model)
    params = sum(p.numel() for p in model.parameters())
    gib = 3 * 4 * params / 2**30
    print(
        f"state: {params / 1e9:.3f}B parameters + Adam = {gib:.2f} GiB "
        f"({len(shapes)} tensors x 3; built in {time.time() - started:.0f} s)",
        flush=True,
    )
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_digests_"))
    variants = ("before", "digests", "no_crc")
    tiny = _model({"warm_up": (8,)})  # one-off costs of a first save, untimed
    for variant in variants:
        _save(root / "warm_up", variant, tiny, None, pg, 0)
    shutil.rmtree(root / "warm_up")
    verify_seconds = []

    def timed_save(variant: str):
        def run(rep: int) -> tuple[float, float]:
            save = root / variant
            shutil.rmtree(save, ignore_errors=True)
            os.sync()  # start from a clean page cache: no other write-back in the timing
            begin, begin_cpu = time.perf_counter(), time.process_time()
            _save(save, variant, model, optimizer, pg, rep + 1)
            wall, cpu = time.perf_counter() - begin, time.process_time() - begin_cpu
            print(f"rep {rep + 1} {variant:>8}: save {wall:6.2f} s (CPU {cpu:5.2f} s)", flush=True)
            if variant == "digests":
                begin = time.perf_counter()
                verified = verify_checkpoint(checkpoint_dir(str(save), rep + 1))
                verify_seconds.append(time.perf_counter() - begin)
                assert verified.ok, verified.problems
            shutil.rmtree(save)
            return wall, cpu

        return run

    try:  # rotating: a drift of the disk's speed during the run favours no variant
        runs = rounds({v: timed_save(v) for v in variants}, args.reps, rotate=True)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    wall = {v: [w for w, _ in runs[v]] for v in variants}
    cpu = {v: [c for _, c in runs[v]] for v in variants}
    med = {v: statistics.median(wall[v]) for v in variants}
    med_cpu = {v: statistics.median(cpu[v]) for v in variants}
    print(
        f"median save over {args.reps} reps: "
        + ", ".join(f"{v} {med[v]:.2f} s (CPU {med_cpu[v]:.2f} s)" for v in variants)
    )
    for a, b in (("digests", "before"), ("digests", "no_crc")):
        pairs = statistics.median(x / y for x, y in zip(wall[a], wall[b]))
        print(
            f"ratio {a} / {b} = {med[a] / med[b]:.3f} ({med[a] - med[b]:+.2f} s; median of the "
            f"reps' ratios {pairs:.3f}; CPU {med_cpu[a] - med_cpu[b]:+.2f} s)"
        )
    check = statistics.median(verify_seconds)
    print(f"verifying on load (one process, every file): {check:.2f} s = {gib / check:.2f} GiB/s")


def _save(path: Path, variant: str, model, optimizer, pg, iteration: int) -> None:
    computed = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(variant == "before")  # (digests: the writer's own)
    try:
        save_checkpoint(
            str(path),
            TrainState(iteration=iteration),
            model,
            optimizer,
            pg=pg,
            args_json={"model_size": "1.2b"},
            digests=variant == "digests",
        )
    finally:
        torch.serialization.set_crc32_options(computed)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
