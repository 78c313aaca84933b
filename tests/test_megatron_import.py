"""megatron_ext/megatron_import.py: megatron-core is first imported there, with its import-time
`torch.compile` decorations deferred to their first call (that every import of megatron in the
project comes after it: tests/test_import_layers.py)."""

from __future__ import annotations

import ast
import functools
import os
import pathlib
import subprocess
import sys
import textwrap
import types

import megatron_ext.megatron_import as megatron_import

import pytest
import torch
from megatron.core import jit

REPO = pathlib.Path(__file__).resolve().parents[1]


class _Recorder:
    """Stands in for the real torch.compile: records each call, returns a marked wrapper."""

    def __init__(self):
        self.calls = []

    def __call__(self, model, **options):
        self.calls.append((model, options))

        @functools.wraps(model)
        def compiled(*args, **kwargs):
            return ("compiled", model(*args, **kwargs))

        return compiled


@pytest.fixture
def recorder(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(megatron_import, "_torch_compile", rec)
    return rec


def _scale(x, factor=2):
    """Doubles."""
    return x * factor


_scale.__module__ = "megatron.core.fusions.example"  # deferred: as if megatron-core defined it


def _other_package(x):
    return x + 1


_other_package.__module__ = "transformer_engine.pytorch.jit"


def test_lazy_compile_defers_then_compiles_once_with_the_same_options(recorder):
    plain = megatron_import.lazy_compile(_scale)
    with_options = megatron_import.lazy_compile(dynamic=True, fullgraph=True)(_scale)
    assert recorder.calls == []  # decorating compiles nothing
    assert (
        plain.__name__ == "_scale" and plain.__doc__ == "Doubles." and plain.__wrapped__ is _scale
    )

    assert plain(3) == ("compiled", 6)
    assert plain(4, factor=3) == ("compiled", 12)
    assert recorder.calls == [(_scale, {})]  # once, on the first call

    assert with_options(5) == ("compiled", 10)
    with_options(6)
    assert recorder.calls == [(_scale, {}), (_scale, {"dynamic": True, "fullgraph": True})]


def test_lazy_compile_works_as_a_method_decorator_and_compiles_modules_at_once(recorder):
    class Norm:
        def forward(self, x):
            return x + 1

        forward.__module__ = "megatron.core.transformer.example"
        forward = megatron_import.lazy_compile(forward)

    assert Norm().forward(1) == ("compiled", 2)
    assert len(recorder.calls) == 1

    module = torch.nn.Linear(2, 2)
    megatron_import.lazy_compile(module, mode="reduce-overhead")
    assert recorder.calls[1] == (module, {"mode": "reduce-overhead"})


def test_lazy_compile_compiles_other_packages_functions_at_once(recorder):
    """Transformer Engine and apex, imported by `import megatron.core` where installed, keep
    torch.compile's own behaviour: only megatron-core's decorations are deferred."""
    compiled = megatron_import.lazy_compile(dynamic=False)(_other_package)
    assert recorder.calls == [(_other_package, {"dynamic": False})]
    assert compiled(1) == ("compiled", 2)
    assert len(recorder.calls) == 1


def test_lazy_compile_runs_the_function_itself_inside_a_compiled_region(recorder, monkeypatch):
    fn = megatron_import.lazy_compile(_scale)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert fn(3) == 6  # what dynamo does with a compiled function it meets while tracing
    assert recorder.calls == []


def test_torch_compile_is_restored_and_megatron_jit_fuser_is_the_lazy_one():
    assert torch.compile is megatron_import._torch_compile
    assert jit.jit_fuser is megatron_import.lazy_compile
    # A megatron fusion decorated at import is the deferred wrapper around megatron's own code.
    from megatron.core.fusions import fused_bias_gelu

    assert (
        fused_bias_gelu.bias_gelu.__wrapped__.__module__ == "megatron.core.fusions.fused_bias_gelu"
    )


def test_import_deferred_runs_the_module_on_first_use_only(tmp_path, monkeypatch):
    package = tmp_path / "deferred_pkg"
    package.mkdir()
    init = "import os\nos.environ['DEFERRED_RUNS'] += 'x'\nVALUE = 3\n"
    (package / "__init__.py").write_text(init)
    (package / "sub.py").write_text("from deferred_pkg import VALUE\nDOUBLE = 2 * VALUE\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("DEFERRED_RUNS", "")
    for name in ("deferred_pkg", "deferred_pkg.sub"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    megatron_import.import_deferred("deferred_pkg")
    import deferred_pkg

    assert deferred_pkg is sys.modules["deferred_pkg"]
    assert deferred_pkg.__file__ == str(package / "__init__.py")  # what inspect.getmodule reads
    assert os.environ["DEFERRED_RUNS"] == ""
    assert deferred_pkg.VALUE == 3 and os.environ["DEFERRED_RUNS"] == "x"
    assert type(deferred_pkg) is types.ModuleType and deferred_pkg.VALUE == 3
    assert os.environ["DEFERRED_RUNS"] == "x"
    # A submodule imported first runs its package first, as a plain import does.
    del sys.modules["deferred_pkg"]
    megatron_import.import_deferred("deferred_pkg")
    from deferred_pkg import sub

    assert sub.DOUBLE == 6 and os.environ["DEFERRED_RUNS"] == "xx"
    monkeypatch.delitem(sys.modules, "deferred_pkg")
    monkeypatch.delitem(sys.modules, "deferred_pkg.sub")


def test_import_deferred_leaves_a_missing_or_imported_module_alone():
    megatron_import.import_deferred("no_such_module_anywhere")
    assert "no_such_module_anywhere" not in sys.modules
    megatron_import.import_deferred("ast")
    assert sys.modules["ast"] is ast


@pytest.mark.integration
def test_the_model_and_training_code_import_neither_dynamo_nor_inductor():
    code = textwrap.dedent(
        """
        import sys
        from megatron_ext.models import LeviathanModel, build_model
        import megatron_ext.training.run
        import megatron.core.models.gpt
        loaded = [m for m in sys.modules if m.startswith(("torch._dynamo", "torch._inductor"))]
        assert "torch._inductor.compile_fx" not in sys.modules, loaded
        assert "torch._dynamo.eval_frame" not in sys.modules, loaded
        # wandb, where installed, is bound by megatron-core but executed on its first use only.
        import importlib.util
        if importlib.util.find_spec("wandb") is not None:
            from megatron.core.inference.contexts import dynamic_context
            assert dynamic_context.HAVE_WANDB
            assert "wandb.sdk" not in sys.modules
            assert callable(dynamic_context.wandb.init) and "wandb.sdk" in sys.modules
        """
    )
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
