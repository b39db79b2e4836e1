"""Megatron-core models under hethub's runtime, and Megatron-core configs in hethub's cost model.

``gpt_layers(config, vocab_size, seq_length)`` turns a megatron-core ``TransformerConfig`` into hethub's
pipeline layer list — embedding, ``TransformerLayer``s with the local (non-Transformer-Engine) spec,
final norm + output layer — so a megatron-core GPT trains under any hethub plan, unequal widths included.
hethub's runtime slices micro-batches by sample (dim 0): the wrappers keep tensors batch-first between
layers and transpose to Megatron's sequence-first layout inside each layer.

On a machine without CUDA, megatron-core reaches for CUDA in three places on this path; ``cpu_compat()``
keeps them away without touching megatron-core's files: its global memory buffer (attention scores) is
replaced by one that allocates on the layer's device; its CUDA RNG tracker by one whose ``fork()`` uses
the default generator; and the causal mask is passed explicitly (Megatron builds the default one with
``device="cuda"``).
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from .partitioner.records import ModelConfig


class _DeviceMemoryBuffer:
    """Stand-in for megatron-core's GlobalMemoryBuffer that allocates where it is asked to compute."""

    def __init__(self, device: torch.device):
        self.device = device
        self.buffer: dict = {}

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        n = 1
        for d in tensor_shape:
            n *= d
        key = (name, dtype)
        if key not in self.buffer or self.buffer[key].numel() < n:
            self.buffer[key] = torch.empty(n, dtype=dtype, device=self.device)
        return self.buffer[key][:n].view(*tensor_shape)


class _DefaultGeneratorTracker:
    """Stand-in for megatron-core's CUDA RNG tracker: forks nothing (tensor parallel is 1 here)."""

    def fork(self, name: str = "model-parallel-rng"):
        return contextlib.nullcontext()

    def add(self, *_a, **_k):
        return None


def cpu_compat() -> None:
    """Initialise megatron-core's parallel state for TP = PP = 1 and keep its CUDA-only calls off this path."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    if not dist.is_initialized():
        from .runtime import DEFAULT_TIMEOUT_S, _init_distributed
        _init_distributed(DEFAULT_TIMEOUT_S)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    if not torch.cuda.is_available():
        parallel_state._GLOBAL_MEMORY_BUFFER = _DeviceMemoryBuffer(torch.device("cpu"))
        mrandom._CUDA_RNG_STATE_TRACKER = _DefaultGeneratorTracker()
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


class MegatronEmbedding(nn.Module):
    def __init__(self, config: Any, vocab_size: int, seq_length: int):
        super().__init__()
        from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
        self.embedding = LanguageModelEmbedding(config=config, vocab_size=vocab_size, max_sequence_length=seq_length,
                                                position_embedding_type="learned_absolute")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
        return self.embedding(ids, pos).transpose(0, 1).contiguous()  # [s, b, h] -> [b, s, h]


class MegatronBlock(nn.Module):
    def __init__(self, config: Any, layer_number: int):
        super().__init__()
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.spec_utils import build_module
        spec = get_gpt_layer_local_spec(num_experts=None, moe_grouped_gemm=False,
                                        qk_layernorm=False) if config.num_moe_experts is None else None
        if spec is None:
            raise ValueError("config.num_moe_experts: mixture-of-experts layers are not supported by hethub yet")
        self.layer = build_module(spec, config=config, layer_number=layer_number)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.shape[1]
        mask = torch.triu(torch.ones(s, s, device=x.device), diagonal=1).bool()[None, None]
        out = self.layer(x.transpose(0, 1), attention_mask=mask)
        out = out[0] if isinstance(out, tuple) else out
        return out.transpose(0, 1).contiguous()


class MegatronHead(nn.Module):
    """Final norm and output layer (Megatron's ColumnParallelLinear, TP = 1)."""

    def __init__(self, config: Any, vocab_size: int):
        super().__init__()
        from megatron.core.tensor_parallel import ColumnParallelLinear
        if config.normalization == "RMSNorm":
            self.norm = nn.RMSNorm(config.hidden_size, eps=config.layernorm_epsilon)
        else:
            self.norm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.output_layer = ColumnParallelLinear(config.hidden_size, vocab_size, config=config,
                                                 init_method=config.init_method, bias=False, gather_output=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits, _ = self.output_layer(self.norm(x))
        return logits


def gpt_layers(config: Any, vocab_size: int, seq_length: int) -> list[nn.Module]:
    """hethub's layer list for a megatron-core GPT: [embedding, TransformerLayer x num_layers, head]."""
    cpu_compat()
    if getattr(config, "tensor_model_parallel_size", 1) != 1:
        raise ValueError(f"config.tensor_model_parallel_size: hethub runs TP = 1, got "
                         f"{config.tensor_model_parallel_size}")
    return [MegatronEmbedding(config, vocab_size, seq_length),
            *[MegatronBlock(config, i + 1) for i in range(config.num_layers)],
            MegatronHead(config, vocab_size)]


def model_config_from_megatron(config: Any, vocab_size: int, seq_length: int, name: str = "megatron-gpt",
                               tie_embeddings: bool = False) -> ModelConfig:
    """A hethub ModelConfig (for the cost model and planner) from a megatron-core TransformerConfig.

    SwiGLU (gated_linear_unit) with RMSNorm reads as a Llama-style block, anything else as GPT;
    grouped-query attention from ``num_query_groups``.
    """
    llama = bool(getattr(config, "gated_linear_unit", False)) and getattr(config, "normalization", "") == "RMSNorm"
    groups = getattr(config, "num_query_groups", None)
    return ModelConfig(name=name, architecture="llama" if llama else "gpt", num_layers=config.num_layers,
                       hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
                       num_key_value_heads=groups if groups and groups != config.num_attention_heads else None,
                       ffn_hidden_size=config.ffn_hidden_size, vocab_size=vocab_size, seq_length=seq_length,
                       tie_embeddings=tie_embeddings)
