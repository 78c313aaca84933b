"""LeviathanModel: megatron-core's GPTModel with a pluggable input embedding.

It keeps GPTModel's `LanguageModelEmbedding` (the [b, s, h] -> [s, b, h] transpose, the
sequence-parallel scatter, the embedding dropout) and replaces only its `word_embeddings` with
the chosen arm's input module; it also swaps in the CPU-safe leaves of `local_modules`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import megatron_ext.megatron_import  # noqa: F401

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_ext.config.model import ModelConfig
from megatron_ext.models.layer_specs import get_decoder_block_spec
from megatron_ext.models.local_modules import (
    PortableRotaryEmbedding,
    PortableTransformerBlock,
    SDPACoreAttention,
    SwiGLUMLP,
)
from megatron_ext.tensor_parallel import (
    PortableColumnParallelLinear,
    PortableVocabParallelEmbedding,
    adopt,
    chunked_head_cross_entropy,
    vocab_parallel_cross_entropy,
)

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig

    from megatron_ext.parallel import ProcessGroups

__all__ = ["LeviathanModel", "InputEmbeddingBuilder"]

# builder(config=TransformerConfig, reduce_scatter_embeddings=bool, tp_group=group) -> the module
# that replaces `embedding.word_embeddings`; it honours VocabParallelEmbedding's forward contract.
InputEmbeddingBuilder = Callable[..., torch.nn.Module]


class LeviathanModel(GPTModel):
    """A LLaMA-style GPT whose input embedding is chosen by `input_embedding_builder`.

    Args:
        config: megatron's TransformerConfig of `model_config` at the run's layout and
            precision (`models.builder.compose_transformer_config`).
        share_embeddings_and_output_weights: the TIED arm (needs a [V/tp, D] input weight).
        input_embedding_builder: None keeps megatron's VocabParallelEmbedding; else it builds
            the replacement (`InputEmbeddingBuilder`) with the model's own TP group.
        transformer_layer_spec: overrides the spec `model_config.transformer_impl` picks.
        pg: the process groups, GPTModel's `pg_collection` (None: megatron's `parallel_state`).
        pre_process, post_process, vp_stage: as GPTModel's; vp_size: chunks per pipeline rank.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        config: "TransformerConfig",
        *,
        pre_process: bool = True,
        post_process: bool = True,
        share_embeddings_and_output_weights: bool = False,
        input_embedding_builder: Optional[InputEmbeddingBuilder] = None,
        transformer_layer_spec: Optional[ModuleSpec] = None,
        parallel_output: bool = True,
        pg: Optional["ProcessGroups"] = None,
        vp_stage: Optional[int] = None,
        vp_size: Optional[int] = None,
    ) -> None:
        if share_embeddings_and_output_weights and input_embedding_builder is not None:
            raise ValueError(
                "tied input/output weights need a [V/tp, D] input table; the chosen input "
                "embedding has none (use --embedding-type tied only with the lookup table)"
            )
        self.model_config = model_config
        if vp_size is not None:
            # Set after construction: megatron sizes and offsets each chunk's layers from it.
            config.virtual_pipeline_model_parallel_size = vp_size
        spec = transformer_layer_spec or get_decoder_block_spec(
            config, model_config.transformer_impl, qk_layernorm=model_config.qk_layernorm
        )
        super().__init__(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=model_config.vocab_size,
            max_sequence_length=model_config.seq_length,
            pre_process=pre_process,
            post_process=post_process,
            parallel_output=parallel_output,
            share_embeddings_and_output_weights=share_embeddings_and_output_weights,
            position_embedding_type="rope",
            rotary_percent=model_config.rotary_percent,
            rotary_base=model_config.rotary_base,
            pg_collection=None if pg is None else pg.megatron_collection(),
            vp_stage=vp_stage,
        )
        self.rotary_pos_emb = PortableRotaryEmbedding(
            kv_channels=config.kv_channels,
            rotary_percent=model_config.rotary_percent,
            rotary_interleaved=config.rotary_interleaved,
            rotary_base=model_config.rotary_base,
            use_cpu_initialization=config.use_cpu_initialization or not torch.cuda.is_available(),
            cp_group=self.pg_collection.cp,
        )
        if config.recompute_granularity == "full" and not torch.cuda.is_available():
            self.decoder = adopt(PortableTransformerBlock, self.decoder)
        if config.recompute_granularity == "selective" and not torch.cuda.is_available():
            for layer in self.decoder.layers:
                attention = layer.self_attention
                if isinstance(attention.core_attention, SDPACoreAttention):
                    attention.checkpoint_core_attention = False
                    attention.core_attention.recompute = True
        if model_config.transformer_impl == "local":
            # Swapped after construction: megatron's TransformerLayer hands the layer's TP
            # group only to an MLP spec whose module is exactly MLP.
            for layer in self.decoder.layers:
                if type(layer.mlp) is MLP:
                    layer.mlp = adopt(SwiGLUMLP, layer.mlp)
        # GPTModel builds these two with megatron's classes, whose sequence-parallel
        # communication allocates on CUDA; their portable twins share the same parameters.
        if pre_process:
            self.embedding.word_embeddings = adopt(
                PortableVocabParallelEmbedding, self.embedding.word_embeddings
            )
        if post_process:
            self.output_layer = adopt(PortableColumnParallelLinear, self.output_layer)
        if pre_process and input_embedding_builder is not None:
            self.embedding.word_embeddings = input_embedding_builder(
                config=config,
                reduce_scatter_embeddings=self.embedding.reduce_scatter_embeddings,
                tp_group=self.embedding.tp_group,
            )

    @property
    def embedding_type(self) -> str:
        """The model's `--embedding-type` (tied, untied, albert, flat-mlp, factored-mlp, lev)."""
        return self.model_config.embedding.embedding_type

    def get_extra_state(self) -> dict:
        """Saved beside the weights so that a checkpoint knows which arm it holds."""
        return {"embedding_type": self.embedding_type}

    def set_extra_state(self, state) -> None:
        """Refuse a checkpoint saved from another embedding arm (ValueError naming both)."""
        saved = state.get("embedding_type") if isinstance(state, dict) else None
        if saved is not None and saved != self.embedding_type:
            raise ValueError(
                f"the checkpoint holds a model with --embedding-type {saved}, but this model "
                f"is --embedding-type {self.embedding_type}; load it into a {saved} model"
            )

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor):
        """Per-token loss [b, s] of logits [s, b, V/tp]: megatron's unfused vocab-parallel
        cross entropy with fewer passes over the logits (`vocab_parallel_cross_entropy`);
        --cross-entropy-loss-fusion keeps megatron's fused one."""
        if self.config.cross_entropy_loss_fusion:
            return super().compute_language_model_loss(labels, logits)
        loss = vocab_parallel_cross_entropy(
            logits, labels.transpose(0, 1).contiguous(), self.pg_collection.tp
        )
        return loss.transpose(0, 1).contiguous()

    def _postprocess(self, hidden_states, input_ids, position_ids, labels, **kwargs):
        """megatron's head and loss; scoring (labels, no autograd, one rank, CPU) takes the
        head and loss in row chunks instead (`chunked_head_cross_entropy`): the same per-token
        losses [b, s] without the float32 [s, b, V] logits and their memory-bound passes."""
        if labels is not None and self._chunked_eval_loss(hidden_states, kwargs):
            weight = (
                self.shared_embedding_or_output_weight()
                if self.share_embeddings_and_output_weights
                else self.output_layer.weight
            )
            loss = chunked_head_cross_entropy(hidden_states, weight, labels.transpose(0, 1))
            return loss.transpose(0, 1).contiguous()
        return super()._postprocess(hidden_states, input_ids, position_ids, labels, **kwargs)

    def _chunked_eval_loss(self, hidden_states: torch.Tensor, kwargs: dict) -> bool:
        if not self.post_process:  # a pipeline stage before the last has no output layer
            return False
        layer = self.output_layer
        return (
            not torch.is_grad_enabled()
            and not hidden_states.is_cuda
            and not kwargs.get("mtp_in_postprocess")
            and self.config.mtp_num_layers is None
            and kwargs.get("inference_context") is None
            and not self.config.cross_entropy_loss_fusion
            and not layer.sequence_parallel
            and layer.bias is None
            and self.pg_collection.tp.size() == 1
        )

    def setup_embeddings_and_output_layer(self) -> None:
        """Megatron's tied-embedding set-up without its `weight.data.cuda()` (fails on CPU)."""
        if torch.cuda.is_available():
            return super().setup_embeddings_and_output_layer()
        if self.pre_process:
            self.embedding.word_embeddings.weight.is_embedding_or_output_parameter = True
        if self.post_process and self.output_layer.weight is not None:
            self.output_layer.weight.is_embedding_or_output_parameter = True
        if not self.share_embeddings_and_output_weights:
            return
        weight = self.shared_embedding_or_output_weight()
        if self.config.pipeline_model_parallel_size == 1:
            weight.zero_out_wgrad = True
            return
        if self.pre_process and not self.post_process:
            weight.shared_embedding = True
        if self.post_process and not self.pre_process:
            # The last stage's copy starts at zero; the all-reduce below copies stage 0's values.
            weight.data.fill_(0)
            weight.shared = True
            weight.shared_embedding = True
        if torch.distributed.is_initialized() and self._is_in_embd_group():
            torch.distributed.all_reduce(weight.data, group=self.embd_group)
