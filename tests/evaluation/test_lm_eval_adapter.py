"""The lm-evaluation-harness adapter: the harness end to end on local tiny tasks (no network),
and its numbers against sums of token log-probabilities computed directly from the model."""

from __future__ import annotations

import json

import pytest
import torch

from tools.make_demo_data import TINY_TASKS, write_tiny_tasks

pytestmark = pytest.mark.integration


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """The harness and `datasets` must not reach the network nor the user's caches."""
    for key in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(key, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))


def test_harness_runs_the_tiny_tasks(eval_runs, tool, tmp_path, capsys, offline):
    tasks = write_tiny_tasks(str(eval_runs.val_jsonl), str(tmp_path / "tasks"), items=4)
    out = tmp_path / "out"
    capsys.readouterr()
    assert tool("lm-eval", "--load", eval_runs.ckpt("lev"), "--tasks", ",".join(TINY_TASKS),
                "--include-path", tasks, "--micro-batch-size", "4", "--max-gen-toks", "4",
                "--log-samples", "--output-dir", out) == 0  # fmt: skip
    printed = capsys.readouterr().out
    for task in TINY_TASKS:
        assert f"|{task}" in printed  # the harness's own table
    results = json.loads((out / "lm_eval.json").read_text())["results"]
    assert 0 <= results["tiny_piqa"]["acc,none"] <= 1
    assert 0 <= results["tiny_piqa"]["acc_norm,none"] <= 1
    assert results["tiny_lambada"]["perplexity,none"] > 1
    assert results["tiny_wikitext"]["word_perplexity,none"] > 1
    assert 0 <= results["tiny_gen"]["exact_match,none"] <= 1
    assert (out / "lm_eval.md").read_text().startswith("|")
    # --log-samples: every item's log-likelihoods, one JSON line each.
    piqa = [json.loads(line) for line in (out / "samples_tiny_piqa.jsonl").read_text().splitlines()]
    assert len(piqa) == 4
    assert all(len(item["resps"]) == len(item["arguments"]) >= 2 for item in piqa)
    assert {"doc", "target", "acc"} <= set(piqa[0])


def _reference_log_prob(model, context: list[int], continuation: list[int], vocab: int):
    """Sum of log p(continuation | context) from the model's own per-token loss, and whether
    every continuation token is the arg-max of the full logits."""
    whole = torch.tensor(context + continuation)
    inputs, labels = whole[:-1].unsqueeze(0), whole[1:].unsqueeze(0)
    positions = torch.arange(inputs.size(1)).unsqueeze(0)
    n = len(continuation)
    with torch.no_grad():
        loss = model(inputs, positions, None, labels=labels)[0, -n:]
        logits = model(inputs, positions, None)[0, -n:, :vocab]
    greedy = bool((logits.argmax(-1) == labels[0, -n:]).all())
    return -float(loss.double().sum()), greedy


def _harness_hf(model_args: str, tasks: str, names: list[str]) -> dict:
    """lm-evaluation-harness's own `--model hf` on `names` (seeded as our adapter's runs)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model="hf",
        model_args=model_args,
        tasks=names,
        task_manager=TaskManager(include_path=tasks),
        batch_size=4,
        random_seed=1234,
        numpy_random_seed=1234,
        torch_random_seed=1234,
        fewshot_random_seed=1234,
    )["results"]


def test_adapter_matches_direct_log_probabilities(eval_runs, environment_unchanged):
    import torch.distributed as dist
    from lm_eval.api.instance import Instance

    from megatron_ext.evaluation.lm_eval_adapter import LeviathanLM
    from megatron_ext.parallel import destroy_parallel

    with environment_unchanged():  # the one-rank world writes no torchrun identity
        lm = LeviathanLM(load=eval_runs.ckpt("lev"), batch_size=2)  # a one-rank world at TP=1
        try:
            model, vocab = lm.scorer.model, lm.tok.vocab_size
            assert lm.max_length == 32
            short = ("Ti tingölplun cionlundmélgain ti y go", " wö be zit")
            long_context = " ".join(["méckgrang hickple daimla bour pean"] * 12)  # > 32 tokens
            pairs = [short, (long_context, " no méckgrang"), ("Bea no,", " méckgrang")]
            requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
            answers = lm.loglikelihood(requests, disable_tqdm=True)
            for (context, continuation), (log_prob, greedy) in zip(pairs, answers):
                ctx_ids, cont_ids = lm._encode_pair(context, continuation)
                whole = (ctx_ids + cont_ids)[-33:]  # left truncation to the 32-token window
                if len(ctx_ids) + len(cont_ids) > 33:
                    assert len(ctx_ids) > 32  # the long case really is truncated
                ref, ref_greedy = _reference_log_prob(
                    model, whole[: -len(cont_ids)], cont_ids, vocab
                )
                assert log_prob == pytest.approx(ref, rel=1e-5, abs=1e-5)
                assert greedy == ref_greedy

            text = "Bea no, méckgrang hickple daimla bour."
            (rolling,) = lm.loglikelihood_rolling(
                [Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True
            )
            ids = lm.tok_encode(text)
            assert len(ids) < 32
            ref, _ = _reference_log_prob(model, [lm.eot_token_id], ids, vocab)
            assert rolling == pytest.approx(ref, rel=1e-5, abs=1e-5)

            prompt = "Ti tingölplun cionlundmélgain ti y"
            (generated,) = lm.generate_until(
                [Instance("generate_until", {}, (prompt, {"until": [], "max_gen_toks": 3}), 0)],
                disable_tqdm=True,
            )
            ids = lm.tok_encode(prompt)
            with torch.no_grad():
                for _ in range(3):  # greedy decoding by full recomputation, no cache
                    x = torch.tensor([ids])
                    logits = model(x, torch.arange(len(ids)).unsqueeze(0), None)[0, -1, :vocab]
                    ids.append(int(logits.argmax()))
            assert generated == lm.tok_decode(ids[-3:])
        finally:
            destroy_parallel()
            if dist.is_initialized():
                dist.destroy_process_group()


def test_harness_hf_model_on_the_export_equals_our_adapter(
    eval_runs, tool, tmp_path, offline, environment_unchanged
):
    """`lm_eval --model hf --model_args pretrained=EXPORT` with no extra argument scores rolling
    (empty-context) and context requests exactly as `tools/evaluate.py lm-eval` on the
    checkpoint: the export declares the EOD id the model was trained with as its BOS."""
    from transformers import AutoTokenizer

    from megatron_ext.conversion import convert_checkpoint

    hf = tmp_path / "hf"
    # tools/convert_checkpoint.py's main, in this process (its one-rank world is torn down)
    argv = ["export-hf", "--load", eval_runs.ckpt("lev"), "--output", str(hf), "--no-progress"]
    with environment_unchanged():
        assert convert_checkpoint.main(argv) == 0
    tokenizer = AutoTokenizer.from_pretrained(hf)
    assert tokenizer.bos_token_id == tokenizer.eos_token_id
    assert tokenizer("Bea no,").input_ids[0] != tokenizer.bos_token_id  # never added to text

    tasks = write_tiny_tasks(str(eval_runs.val_jsonl), str(tmp_path / "tasks"), items=4)
    # tiny_piqa's choices outrun the 32-token window, which the hf model refuses (an assert).
    names = ["tiny_wikitext", "tiny_lambada"]
    assert tool("lm-eval", "--load", eval_runs.ckpt("lev"), "--tasks", ",".join(names),
                "--include-path", tasks, "--micro-batch-size", "4",
                "--output-dir", tmp_path / "ours") == 0  # fmt: skip
    ours = json.loads((tmp_path / "ours" / "lm_eval.json").read_text())["results"]
    theirs = _harness_hf(f"pretrained={hf},dtype=float32,device=cpu", tasks, names)  # no prefix
    for task, metric in [
        ("tiny_wikitext", "word_perplexity,none"),
        ("tiny_wikitext", "bits_per_byte,none"),
        ("tiny_lambada", "perplexity,none"),
        ("tiny_lambada", "acc,none"),
    ]:
        assert theirs[task][metric] == pytest.approx(ours[task][metric], rel=1e-4), (task, metric)


def test_harness_hf_model_on_the_leviathan_export_equals_the_llama_export(
    eval_runs, tmp_path, offline, environment_unchanged
):
    """`lm_eval --model hf` with trust_remote_code=True on the export that keeps LEV
    (`--hf-format leviathan`) gives the numbers of the materialised Llama export."""

    from megatron_ext.conversion import convert_checkpoint

    tasks = write_tiny_tasks(str(eval_runs.val_jsonl), str(tmp_path / "tasks"), items=4)
    names = ["tiny_wikitext", "tiny_lambada"]
    results = {}
    for fmt in ("llama", "leviathan"):
        out = tmp_path / fmt
        argv = ["export-hf", "--load", eval_runs.ckpt("lev"), "--output", str(out),
                "--hf-format", fmt, "--no-progress"]  # fmt: skip
        with environment_unchanged():
            assert convert_checkpoint.main(argv) == 0
        model_args = f"pretrained={out},dtype=float32,device=cpu,trust_remote_code=True"
        results[fmt] = _harness_hf(model_args, tasks, names)
    for task, metric in [
        ("tiny_wikitext", "word_perplexity,none"),
        ("tiny_wikitext", "bits_per_byte,none"),
        ("tiny_lambada", "perplexity,none"),
        ("tiny_lambada", "acc,none"),
    ]:
        kept, materialised = results["leviathan"][task][metric], results["llama"][task][metric]
        assert kept == pytest.approx(materialised, rel=1e-5), (task, metric)
