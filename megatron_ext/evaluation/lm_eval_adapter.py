"""lm-evaluation-harness model class for our checkpoints (any arm, any TP).

Importing this module registers the model as `leviathan`, so that
`lm_eval.simple_evaluate(model="leviathan", model_args="load=ckpt/lev,batch_size=32", ...)`
works as well as `tools/evaluate.py lm-eval`. Requests are scored in batches, longest first;
a context too long is truncated on the left; `generate_until` continues greedily with
`inference.generation.generate` and cuts at the first stop string.
"""

from __future__ import annotations

import logging
from typing import Optional

from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import Collator
from tqdm.auto import tqdm

from megatron_ext.evaluation.scoring import (
    LoadedModel,
    batch_of_rows,
    load_for_evaluation,
    rank0,
)
from megatron_ext.inference.generation import SamplingConfig, decode_step_for, generate
from megatron_ext.inference.loading import init_inference_parallel

logger = logging.getLogger(__name__)

__all__ = ["LeviathanLM"]


@register_model("leviathan", "megatron_ext")
class LeviathanLM(TemplateLM):
    """A training checkpoint (`load`, or an already `loaded` model) as an lm-eval language
    model at the given TP x PP layout; `max_length` defaults to the run's --seq-length."""

    def __init__(
        self,
        load: Optional[str] = None,
        *,
        loaded: Optional[LoadedModel] = None,
        batch_size: int | str = 16,
        max_length: Optional[int] = None,
        max_gen_toks: int = 256,
        iteration: Optional[int] = None,
        tokenizer_model: Optional[str] = None,
        tensor_model_parallel_size: int = 1,
        pipeline_model_parallel_size: int = 1,
        **kwargs,
    ) -> None:
        super().__init__()
        if loaded is None:
            if load is None:
                raise ValueError("LeviathanLM needs model_args load=<checkpoint directory>")
            pg = init_inference_parallel(
                int(tensor_model_parallel_size), int(pipeline_model_parallel_size)
            )
            loaded = load_for_evaluation(
                load,
                pg,
                iteration=None if iteration is None else int(iteration),
                tokenizer_model=tokenizer_model,
            )
        self.scorer = loaded.scorer
        self.tok = loaded.tokenizer
        self.batch_size = int(batch_size) if str(batch_size) != "auto" else 16
        self.max_length = int(max_length or loaded.seq_length)
        self.max_gen_toks = int(max_gen_toks)

    @property
    def eot_token_id(self) -> int:
        """The tokenizer's end-of-document id."""
        return self.tok.eod

    @property
    def tokenizer_name(self) -> str:
        """The tokenizer model's path."""
        return str(self.tok.model_path)

    @property
    def rank(self) -> int:
        """0: every rank of the TP x PP world computes the same results."""
        return 0

    @property
    def world_size(self) -> int:
        """1: the TP x PP ranks act as one harness worker."""
        return 1

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs):
        """Token ids of `string`; no special tokens are added (`add_special_tokens` is ignored)."""
        return self.tok.tokenize(string)

    def tok_decode(self, ids) -> str:
        """Text of the token ids `ids`."""
        return self.tok.detokenize(list(ids))

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        """[(key, context ids, continuation ids)] -> [(sum of log-probs, all greedy)]."""

        def order(request):
            ids = request[1] + request[2]
            return -len(ids), tuple(ids)

        collator = Collator(requests, sort_fn=order)
        results = []
        bar = tqdm(total=len(requests), disable=disable_tqdm or not rank0(), desc="scoring")
        for chunk in collator.get_batched(n=self.batch_size):
            rows = []
            for _, context, continuation in chunk:
                # Left truncation: keep the last max_length + 1 ids (inputs are all but the last).
                whole = (context + continuation)[-(self.max_length + 1) :]
                first = max(len(whole) - 1 - len(continuation), 0)  # its first scored label
                rows.append((whole[:-1], whole[1:], first))
            batch = batch_of_rows(rows, max(len(r[0]) for r in rows))
            log_probs, greedy = self.scorer.target_scores(batch.tokens, batch.labels)
            for i, (inp, _, first) in enumerate(rows):
                span = slice(first, len(inp))
                answer = (float(log_probs[i, span].double().sum()), bool(greedy[i, span].all()))
                results.append(answer)
                self.cache_hook.add_partial("loglikelihood", chunk[i][0], answer)
            bar.update(len(rows))
        bar.close()
        return collator.get_original(results)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Total log-likelihood of each whole text (disjoint windows of max_length tokens)."""
        windows, owners = [], []
        for index, (string,) in enumerate(req.args for req in requests):
            pieces = lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for context, continuation in map(lm_utils.make_disjoint_window, pieces):
                windows.append(((None, None), context, continuation))
                owners.append(index)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for owner, (log_prob, _) in zip(owners, scores):
            totals[owner] += log_prob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuation of each context, cut at the first of its `until` strings."""

        def order(request):
            ids = self.tok_encode(request[0])
            return -len(ids), request[0]

        collator = Collator(
            [req.args for req in requests],
            sort_fn=order,
            group_by="gen_kwargs",
            group_fn=lambda x: x[1],
        )
        results = []
        step, why = decode_step_for(self.scorer.model)
        if rank0():
            logger.info("generate_until: decode step %s (%s)", step, why)
        bar = tqdm(total=len(requests), disable=disable_tqdm or not rank0(), desc="generating")
        for chunk in collator.get_batched(n=self.batch_size):
            kwargs = dict(chunk[0][1])
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            if kwargs.get("do_sample") or float(kwargs.get("temperature", 0.0) or 0.0) > 0:
                logger.warning("generate_until: sampling settings ignored, decoding greedily")
            budget = max(1, self.max_length - max_new)
            prompts = [
                self.tok_encode(context)[-budget:] or [self.eot_token_id] for context, _ in chunk
            ]
            cfg = SamplingConfig(max_new_tokens=max_new, stop_token_ids=(self.eot_token_id,))
            outputs = generate(
                self.scorer.model,
                prompts,
                cfg,
                tp_group=self.scorer.pg.tp,
                vocab_size=self.tok.vocab_size,
                step=step,
            )
            for (context, gen_kwargs), ids in zip(chunk, outputs):
                text = self.tok_decode(ids)
                for stop in until:
                    if stop and stop in text:
                        text = text.split(stop)[0]
                results.append(text)
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            bar.update(len(chunk))
        bar.close()
        return collator.get_original(results)
