"""Library code gets its process groups passed in: only `megatron_ext/parallel.py` reads
megatron's `parallel_state` (`ProcessGroups.from_megatron` / `ProcessGroups.current`).

Scanned: the package, tools/ and benchmarks/. Not scanned: pretrain_leviathan.py, the entry
script, whose context-parallel helpers run inside Megatron's `forward_step(data_iterator,
model)` contract, which carries no groups; and the tests, which compare against megatron's own
state on purpose. megatron-core's own layers read their globals when a model is built without
`pg` (Megatron's `model_provider(pre_process, post_process)` contract): that is megatron's code.
"""

from __future__ import annotations

import ast

from tests.support.runs import REPO

ALLOWED = {"megatron_ext/parallel.py"}
SCANNED = ("megatron_ext", "tools", "benchmarks")
MODULE = "megatron.core.parallel_state"


def _global_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, text) of every use of a `parallel_state` function (`get_*`, `is_*`,
    `model_parallel_is_initialized`, ...), whatever the module or function is imported as."""
    aliases, functions = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "megatron.core":
            aliases |= {a.asname or a.name for a in node.names if a.name == "parallel_state"}
        elif isinstance(node, ast.ImportFrom) and node.module == MODULE:
            functions |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == MODULE and a.asname}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            base = node.value
            dotted = isinstance(base, ast.Attribute) and ast.unparse(base) == MODULE
            if (isinstance(base, ast.Name) and base.id in aliases) or dotted:
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Name) and node.id in functions:
            found.append((node.lineno, node.id))
    return found


def test_only_parallel_py_reads_megatron_process_group_globals():
    offenders = []
    for folder in SCANNED:
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel in ALLOWED:
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
            offenders += [f"{rel}:{line}: {text}" for line, text in _global_reads(tree)]
    assert not offenders, (
        "library code reads megatron's process-group globals; take a ProcessGroups (or the "
        "group) as an argument instead:\n" + "\n".join(offenders)
    )


def test_the_scan_sees_every_spelling():
    source = """
import megatron_ext.megatron_import  # noqa: F401
from megatron.core import parallel_state
from megatron.core import parallel_state as ps
from megatron.core.parallel_state import get_tensor_model_parallel_group as tp_group
import megatron.core.parallel_state
import megatron.core.parallel_state as mps
parallel_state.get_data_parallel_group()
ps.is_pipeline_first_stage()
tp_group()
megatron.core.parallel_state.model_parallel_is_initialized()
mps.get_context_parallel_rank()
"""
    found = [text for _, text in _global_reads(ast.parse(source))]
    assert found == [
        "parallel_state.get_data_parallel_group",
        "ps.is_pipeline_first_stage",
        "tp_group",
        "megatron.core.parallel_state.model_parallel_is_initialized",
        "mps.get_context_parallel_rank",
    ]
    # ... and the allowed reader really reads them (the scan is not vacuous).
    parallel = (REPO / "megatron_ext" / "parallel.py").read_text(encoding="utf-8")
    assert len(_global_reads(ast.parse(parallel))) >= 8
