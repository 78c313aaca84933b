"""export-hf --hf-format leviathan: a transformers `LeviathanForCausalLM` that keeps LEV, on the
session's LEV checkpoint (trained by `pretrain_leviathan.py` at TP=2, tests/conftest.py):

- its logits equal ours at TP=1 and the materialised Llama export's; greedy `generate()` equals
  the Llama export's and `tools/generate.py`'s, token for token;
- it loads with `trust_remote_code=True` in a process where megatron_ext and megatron.core
  cannot be imported, from the code the export carries, and gives the same logits;
- import-hf reads it back exactly, and `pretrain_leviathan.py --finetune` trains the import as
  it trains the original (same first losses);
- one AdamW step in transformers gives LEV's parameters gradients and changes them;
  save_pretrained + from_pretrained give the same model;
- bad input: one line, exit 2, nothing written.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from tests.support.distributed import run_distributed

pytestmark = pytest.mark.integration

LEV_PARAMETERS = (
    "codebooks", "seed_proj", "seed_norm_weight", "seed_norm_bias", "spline_delta", "out_proj"
)  # fmt: skip
PROMPTS = [[5, 17, 33, 2], [9, 9], [100, 200, 300, 400, 500, 7]]


def _ids(vocab: int, shape=(3, 32)) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(7))


def _convert(argv: list[str]) -> tuple[int, str]:
    """tools/convert_checkpoint.py's main in this process: (exit code, stderr)."""
    from megatron_ext.conversion import convert_checkpoint

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = convert_checkpoint.main(argv)
    return code, err.getvalue()


def _greedy(hf, prompt: list[int], n: int, eos: int) -> list[int]:
    out = hf.generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=eos,
        pad_token_id=eos, attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )[0, len(prompt):].tolist()  # fmt: skip
    return out[: out.index(eos)] if eos in out else out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _single_checks(trained: dict, out: str) -> dict:
    from transformers import AutoModelForCausalLM

    from megatron_ext.conversion.export_hf import ExportHFOptions, export_hf
    from megatron_ext.conversion.hf_leviathan import LeviathanForCausalLM
    from megatron_ext.conversion.import_hf import ImportHFOptions, import_hf
    from megatron_ext.conversion.source import load_checkpoint_full
    from megatron_ext.inference.generation import SamplingConfig, generate

    lev = trained["ckpt"]["lev"]
    res: dict = {}
    lev_dir, llama_dir = f"{out}/hf_lev", f"{out}/hf_llama"
    export_hf(ExportHFOptions(load=lev, output=lev_dir, hf_format="leviathan", progress=False))
    export_hf(ExportHFOptions(load=lev, output=llama_dir, progress=False))
    res["files"] = sorted(os.listdir(lev_dir))
    res["config"] = json.load(open(f"{lev_dir}/config.json"))

    # In this process the package registered the model: no trust_remote_code needed.
    kept = AutoModelForCausalLM.from_pretrained(lev_dir, dtype=torch.float32).eval()
    llama = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    res["class"] = (type(kept) is LeviathanForCausalLM, type(llama).__name__)
    loaded = load_checkpoint_full(lev, progress=False)
    vocab = kept.config.vocab_size
    ids = _ids(vocab)
    with torch.no_grad():
        ours = loaded.model(ids, None, None, runtime_gather_output=True)[..., :vocab].double()
        theirs, materialised = kept(ids).logits.double(), llama(ids).logits.double()
    res["vs_ours"] = _rel(theirs, ours)
    res["vs_llama"] = _rel(theirs, materialised)
    res["logits"] = theirs.numpy()
    eos = kept.generation_config.eos_token_id
    res["generate"] = [
        (_greedy(kept, p, 12, eos), _greedy(llama, p, 12, eos)) for p in PROMPTS
    ]  # fmt: skip
    ours_greedy = generate(loaded.model, PROMPTS, SamplingConfig(max_new_tokens=12))
    res["generate_ours"] = [
        (r[: r.index(eos)] if eos in r else r) for r in ours_greedy
    ]  # fmt: skip

    # Round trip: export (padding rows kept) -> import -> every parameter bit for bit.
    padded = f"{out}/hf_lev_padded"
    export_hf(ExportHFOptions(load=lev, output=padded, hf_format="leviathan",
                              keep_padded_vocab=True, progress=False))  # fmt: skip
    imported = import_hf(ImportHFOptions(hf_dir=padded, output=f"{out}/imp_lev"))
    back = load_checkpoint_full(imported, progress=False)
    res["roundtrip"] = (
        sorted(loaded.full) == sorted(back.full),
        [k for k in loaded.full if not torch.equal(loaded.full[k], back.full[k])],
        back.embedding_type,
        back.run.iteration,
    )

    # One fine-tuning step in transformers: LEV's generator learns, no table.
    model = AutoModelForCausalLM.from_pretrained(lev_dir, dtype=torch.float32)
    model.train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    emb = model.model.embed_tokens
    res["lev_grads"] = {
        n: float(getattr(emb, n).grad.abs().max()) if getattr(emb, n).grad is not None else None
        for n in LEV_PARAMETERS
    }
    optimizer.step()
    res["lev_changed"] = {
        n: not torch.equal(before[f"model.embed_tokens.{n}"], getattr(emb, n).detach())
        for n in LEV_PARAMETERS
    }
    res["ft_param_names"] = sorted(n for n, _ in model.named_parameters())
    model.eval()
    tuned_dir = f"{out}/hf_lev_tuned"
    model.save_pretrained(tuned_dir)
    reloaded = AutoModelForCausalLM.from_pretrained(tuned_dir, dtype=torch.float32).eval()
    a, b = model.state_dict(), reloaded.state_dict()
    with torch.no_grad():
        res["reload"] = (
            sorted(a) == sorted(b),
            all(torch.equal(a[k], b[k]) for k in a),
            torch.equal(model(ids).logits, reloaded(ids).logits),
            not torch.equal(model(ids).logits, kept(ids).logits),
        )
    res["bad"] = _bad_inputs(trained, out)
    return res


def _bad_inputs(trained: dict, out: str) -> dict:
    """(exit code, stderr) of each bad input, and the outputs or temporaries left behind."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    bad: dict = {}
    lev_dir = f"{out}/hf_lev"
    tied = trained["ckpt"]["tied"]
    bad["tied_as_leviathan"] = _convert(
        ["export-hf", "--load", tied, "--output", f"{out}/y1", "--hf-format", "leviathan"]
    )
    os.makedirs(f"{out}/gpt2")
    json.dump({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 512},
              open(f"{out}/gpt2/config.json", "w"))  # fmt: skip
    bad["other_architecture"] = _convert(["import-hf", "--hf-dir", f"{out}/gpt2",
                                          "--output", f"{out}/y2"])  # fmt: skip
    wrong = f"{out}/wrong_fields"
    shutil.copytree(lev_dir, wrong)
    config = json.load(open(f"{wrong}/config.json"))
    config["lev_seed_dim"] *= 2
    json.dump(config, open(f"{wrong}/config.json", "w"))
    bad["fields_mismatch"] = _convert(["import-hf", "--hf-dir", wrong, "--output", f"{out}/y3"])
    big = f"{out}/big_tokenizer"
    shutil.copytree(lev_dir, big)
    for name in ("tokenizer.json", "tokenizer_config.json", "leviathan_tokenizer.json"):
        os.remove(f"{big}/{name}")
    vocab = {f"w{i}": i for i in range(1000)}
    backend = Tokenizer(WordLevel(vocab, unk_token="w0"))
    PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="w0", eos_token="w1"
    ).save_pretrained(big)
    bad["tokenizer_size"] = _convert(["import-hf", "--hf-dir", big, "--output", f"{out}/y4"])
    bad["wrong_arm"] = _convert(["import-hf", "--hf-dir", lev_dir, "--output", f"{out}/y5",
                                 "--embedding-type", "untied"])  # fmt: skip
    bad["left"] = sorted(n for n in os.listdir(out) if n.startswith((".y", "y")))
    return bad


@pytest.fixture(scope="module")
def results(trained, tmp_path_factory) -> dict:
    out = str(tmp_path_factory.mktemp("leviathan"))
    return {"out": out, **run_distributed(_single_checks, 1, args=(trained, out), timeout=900)[0]}


def test_export_holds_lev_and_its_code(results):
    files, config = results["files"], results["config"]
    assert {"configuration_leviathan.py", "modeling_leviathan.py", "lev_math.py"} <= set(files)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    assert config["model_type"] == "leviathan"
    assert config["architectures"] == ["LeviathanForCausalLM"]
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_leviathan.LeviathanForCausalLM"
    assert config["lev_num_heads"] == 2 and config["lev_rank"] == 4 and config["lev_base"] == 8
    assert config["leviathan"]["hf_format"] == "leviathan"
    assert results["class"] == (True, "LlamaForCausalLM")
    # The exported LEV math is the package's file, its imports made local; nothing else changed.
    from megatron_ext.lev import math as lev_math

    exported = open(os.path.join(results["out"], "hf_lev", "lev_math.py")).read()
    assert exported.split("\n", 1)[1] == open(lev_math.__file__).read()
    modeling = open(os.path.join(results["out"], "hf_lev", "modeling_leviathan.py")).read()
    assert not re.search(r"^\s*(from|import)\s+megatron", modeling, re.MULTILINE)
    assert "from .lev_math import" in modeling


def test_logits_equal_ours_and_the_materialised_export(results):
    assert results["vs_ours"] <= 1e-5
    assert results["vs_llama"] <= 1e-5


def test_greedy_generate_equals_the_materialised_export_and_ours(results):
    pairs = results["generate"]
    assert any(len(kept) > 0 for kept, _ in pairs)
    for (kept, materialised), ours in zip(pairs, results["generate_ours"]):
        assert kept == materialised == ours


def test_import_round_trip_is_exact(results):
    same_keys, different, embedding_type, iteration = results["roundtrip"]
    assert same_keys and different == []
    assert embedding_type == "lev" and iteration == 0


def test_a_transformers_step_trains_lev(results):
    assert all(g is not None and g > 0 for g in results["lev_grads"].values()), results["lev_grads"]
    assert all(results["lev_changed"].values()), results["lev_changed"]
    # no [V, D] input table among the trained parameters
    assert "model.embed_tokens.weight" not in results["ft_param_names"]
    same_keys, equal, same_logits, moved = results["reload"]
    assert same_keys and equal and same_logits and moved


_ISOLATED = textwrap.dedent(
    """
    import importlib, importlib.abc, json, sys

    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("megatron_ext", "megatron"):
                raise ImportError(f"{name} is blocked in this process")
            return None

    sys.meta_path.insert(0, Blocker())
    blocked = []
    for name in ("megatron_ext", "megatron.core"):
        try:
            importlib.import_module(name)
        except ImportError:
            blocked.append(name)
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    model_dir, out = sys.argv[1], sys.argv[2]
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, trust_remote_code=True, dtype=torch.float32
    ).eval()
    ids = torch.randint(0, model.config.vocab_size, (3, 32),
                        generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        np.save(out, model(ids).logits.double().numpy())
    print(json.dumps({
        "blocked": blocked,
        "class": type(model).__module__ + "." + type(model).__name__,
        "loaded": sorted(m for m in sys.modules if m.split(".")[0] in ("megatron_ext", "megatron")),
    }))
    """
)


def test_export_loads_without_the_package(results, tmp_path):
    """`python -I` (no checkout, no PYTHONPATH on sys.path) with megatron_ext and megatron
    blocked: transformers loads the export's own code and gives the same logits."""
    script = tmp_path / "load.py"
    script.write_text(_ISOLATED)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "HF_"))}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1")
    lev_dir = os.path.join(results["out"], "hf_lev")
    proc = subprocess.run(
        [sys.executable, "-I", str(script), lev_dir, str(tmp_path / "logits.npy")],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["blocked"] == ["megatron_ext", "megatron.core"]
    assert report["loaded"] == []
    assert report["class"].startswith("transformers_modules.")
    assert report["class"].endswith("modeling_leviathan.LeviathanForCausalLM")
    logits = np.load(tmp_path / "logits.npy")
    np.testing.assert_array_equal(logits, results["logits"])


def test_finetuning_the_import_trains_as_the_original(results, trained, tmp_path):
    """`pretrain_leviathan.py --finetune` from the imported LEV checkpoint and from the original
    run the same steps: the imported weights are the trained ones, and they train."""
    from tests.support.runs import TINY_LEV_MODEL, TINY_TRAIN, train

    model = [*TINY_LEV_MODEL, "--group-query-attention", "--num-query-groups", "2"]
    losses = {}
    for name, load in (("original", trained["ckpt"]["lev"]),
                       ("imported", os.path.join(results["out"], "imp_lev"))):  # fmt: skip
        run = train(1, [*model, *TINY_TRAIN, *trained["data"], "--load", load, "--finetune",
                        "--exit-interval", "2", "--eval-iters", "0"], tmp_path / name)  # fmt: skip
        losses[name] = run.check().losses
    assert sorted(losses["imported"]) == [1, 2]
    for iteration, loss in losses["original"].items():
        assert losses["imported"][iteration] == pytest.approx(loss, rel=1e-6)


BAD_INPUTS = {
    "tied_as_leviathan": "--embedding-type tied model; use --hf-format llama",
    "other_architecture": "not a Llama-like model",
    "fields_mismatch": "config.json's lev_* fields imply",
    "tokenizer_size": "vocabulary mismatch",
    "wrong_arm": "imports as --embedding-type lev",
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_line(results, case):
    code, err = results["bad"][case]
    assert code == 2
    lines = [line for line in err.strip().splitlines() if not line.startswith("[")]
    assert len(lines) == 1 and BAD_INPUTS[case] in lines[0], err


def test_bad_input_leaves_nothing(results):
    assert results["bad"]["left"] == []


def test_importing_the_conversion_tool_does_not_import_transformers():
    """The subpackage (transformers, seconds) is imported only by the leviathan paths."""
    code = (
        "import sys, megatron_ext, megatron_ext.conversion.convert_checkpoint; "
        "print(sorted(m for m in ('transformers', 'megatron.core') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
