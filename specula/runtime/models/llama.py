"""Llama decoder (arXiv 2302.13971, 2407.21783): the modules holding the weights, under Hugging Face
``LlamaForCausalLM`` names, ``q/k/v_proj`` and ``gate/up_proj`` fused (``packed_modules_mapping``);
the paged forward is :class:`~specula.runtime.worker.model_runner.ModelRunner`'s.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from specula.runtime.kernels.gemv import argmax, linear, linear_argmax
from specula.runtime.models.config import ModelConfig, check_aux_layer_ids
from specula.runtime.models.layers import MergedLinear, RMSNorm, RotaryEmbedding, sharded
from specula.runtime.worker.parallel import (
    VocabParallelEmbedding,
    gather_argmax,
    gather_vocab,
    get_parallel,
)


class LlamaAttention(nn.Module):
    """This rank's heads: ``1/tensor_parallel_size`` of the query and key/value heads
    (``qkv_proj`` column-parallel, ``o_proj`` row-parallel)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        tp = config.tensor_parallel_size
        self.num_heads = config.num_attention_heads // tp
        self.num_kv_heads = config.num_key_value_heads // tp
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        h, bias = config.hidden_size, config.attention_bias
        self.qkv_proj = sharded(MergedLinear(h, [q_size, kv_size, kv_size], bias), "colwise", tp)
        self.o_proj = sharded(nn.Linear(q_size, h, bias=bias), "rowwise", tp)


class LlamaMLP(nn.Module):
    """SwiGLU MLP; this rank's ``1/tensor_parallel_size`` of the intermediate columns."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        tp, h, bias = config.tensor_parallel_size, config.hidden_size, config.mlp_bias
        inter = config.intermediate_size // tp
        self.gate_up_proj = sharded(MergedLinear(h, [inter, inter], bias), "colwise", tp)
        self.down_proj = sharded(nn.Linear(inter, h, bias=bias), "rowwise", tp)


class LlamaDecoderLayer(nn.Module):
    attention_cls: type[LlamaAttention] = LlamaAttention

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaModel(nn.Module):
    layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   config.tensor_parallel_size)
        self.layers = nn.ModuleList(self.layer_cls(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Causal LM weights; callers project (:meth:`compute_logits`) only positions they sample."""

    model_cls: type[LlamaModel] = LlamaModel
    packed_modules_mapping: dict[str, list[str]] = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                                                    "gate_up_proj": ["gate_proj", "up_proj"]}
    """Fused parameter -> the checkpoint projections stacked in it, in row order."""

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        super().__init__()
        self.config = config
        self.model = self.model_cls(config)
        self.lm_head = None if config.tie_word_embeddings else sharded(nn.Linear(
            config.hidden_size, self.model.embed_tokens.num_embeddings, bias=False
        ), "vocab", config.tensor_parallel_size)
        self.rotary = RotaryEmbedding.from_config(config, device)
        self._full_vocab: tuple[nn.Embedding, torch.Tensor] | None = None
        self.lm_head_screen: tuple[torch.Tensor, torch.Tensor] | None = None
        """The head's 8-bit copy for greedy tokens without logits (a greedy draft's), set by
        its speculator (:func:`~specula.runtime.kernels.gemv.screen_weight`)."""

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def check_aux_hidden_state_layers(self, layer_ids: Sequence[int]) -> tuple[int, ...]:
        """:func:`~specula.runtime.models.config.check_aux_layer_ids` for this model."""
        return check_aux_layer_ids(layer_ids, self.config.num_hidden_layers)

    def full_vocab_weights(self) -> tuple[nn.Embedding, torch.Tensor]:
        """``(embedding, lm_head weight [vocab_size, hidden_size])`` of the whole
        vocabulary, for a draft that shares them and runs unsharded on every rank;
        gathered once at tensor_parallel_size > 1 (collective: every rank calls it)."""
        if self.config.tensor_parallel_size == 1:
            return self.model.embed_tokens, self.lm_head_weight
        if self._full_vocab is None:
            vocab = self.config.vocab_size
            embed_weight = gather_vocab(self.model.embed_tokens.weight, vocab, dim=0)
            embed = nn.Embedding(vocab, self.config.hidden_size, _weight=embed_weight)
            head = embed_weight if self.lm_head is None else gather_vocab(self.lm_head.weight, vocab, dim=0)
            self._full_vocab = (embed.requires_grad_(False), head)
        return self._full_vocab

    def vocab_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_positions, hidden_size] -> [num_positions, vocab_size] logits in the
        model's dtype (the ranks' vocabulary shards gathered)."""
        return gather_vocab(linear(hidden, self.lm_head_weight), self.config.vocab_size)

    def vocab_argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_positions, hidden_size] -> [num_positions] int64 greedy tokens over the
        whole vocabulary without gathering the logits: this rank's shard with the argmax
        epilogue, then :func:`~specula.runtime.worker.parallel.gather_argmax`."""
        weight, rank = self.lm_head_weight, get_parallel().rank
        rows = weight.shape[0]
        valid = self.config.vocab_size - rank * rows  # < rows: a padded last shard
        into = (torch.empty(2, hidden.shape[0], dtype=torch.float32, device=hidden.device), rank * rows)
        if valid >= rows:
            linear_argmax(hidden, weight, into)
        else:  # the logits of vocab_logits' product, the padding never the maximum
            logits = linear(hidden, weight)
            logits[:, max(valid, 0) :] = float("-inf")
            argmax(logits, into)
        return gather_argmax(into[0])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_positions, hidden_size] -> [num_positions, vocab_size] float32 logits."""
        return self.vocab_logits(hidden).float()
