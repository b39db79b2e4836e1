"""Megatron-core models under hethub's runtime, and Megatron-core configs in hethub's cost model.

``gpt_layers(config, vocab_size, seq_length)`` turns a megatron-core ``TransformerConfig`` into hethub's
pipeline layer list — embedding, ``TransformerLayer``s with the local (non-Transformer-Engine) spec,
final norm + output layer — so a megatron-core GPT trains under any hethub plan, unequal widths included.
hethub's runtime slices micro-batches by sample (dim 0): the wrappers keep tensors batch-first between
layers and transpose to Megatron's sequence-first layout inside each layer.

Tensor parallelism: the layers are built whole; on a stage with ``tensor_parallel`` > 1 hethub calls each
block's ``split_tensor_parallel(group)``, which rebuilds it with megatron-core's parallel layers over the
replica's own group (megatron-core's ``pg_collection``), so stages of different degrees coexist. The
embedding and the head run whole on every rank of the group.

On a machine without CUDA, megatron-core reaches for CUDA in three places on this path; ``cpu_compat()``
keeps them away without touching megatron-core's files: its global memory buffer (attention scores) is
replaced by one that allocates on the layer's device; its CUDA RNG tracker by one whose ``fork()`` uses
the default generator; and the causal mask is passed explicitly (Megatron builds the default one with
``device="cuda"``).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..partitioner.records import ModelConfig
from ..runtime.startup import DEFAULT_TIMEOUT_S, init_distributed
from ..runtime.tp import mark_split


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
    """Stand-in for megatron-core's CUDA RNG tracker: forks nothing (dropout draws from the default generator)."""

    def fork(self, name: str = "model-parallel-rng"):
        return contextlib.nullcontext()

    def add(self, *_a, **_k):
        return None


def cpu_compat() -> None:
    """Initialise megatron-core's parallel state for TP = PP = 1 and keep its CUDA-only calls off this path."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    if not dist.is_initialized():
        init_distributed(DEFAULT_TIMEOUT_S)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    if not torch.cuda.is_available():
        parallel_state._GLOBAL_MEMORY_BUFFER = _DeviceMemoryBuffer(torch.device("cpu"))
        mrandom._CUDA_RNG_STATE_TRACKER = _DefaultGeneratorTracker()
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    elif "model-parallel-rng" not in mrandom.get_cuda_rng_tracker().get_states():
        # attention dropout forks this state; megatron's own start-up seeds it, hethub's must too
        mrandom.model_parallel_cuda_manual_seed(torch.initial_seed() % (2 ** 31))


class MegatronEmbedding(nn.Module):
    def __init__(self, config: Any, vocab_size: int, seq_length: int):
        super().__init__()
        from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
        self.embedding = LanguageModelEmbedding(config=config, vocab_size=vocab_size, max_sequence_length=seq_length,
                                                position_embedding_type="learned_absolute")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
        return self.embedding(ids, pos).transpose(0, 1).contiguous()  # [s, b, h] -> [b, s, h]


def _local_layer(config: Any, layer_number: int, pg_collection: Any = None) -> nn.Module:
    """A megatron-core TransformerLayer with the local (non-Transformer-Engine) spec."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    if config.num_moe_experts is not None:
        raise ValueError("config.num_moe_experts: mixture-of-experts layers are not supported by hethub yet")
    spec = get_gpt_layer_local_spec(num_experts=None, moe_grouped_gemm=False, qk_layernorm=False)
    extra = {} if pg_collection is None else {"pg_collection": pg_collection}
    return build_module(spec, config=config, layer_number=layer_number, **extra)


class MegatronBlock(nn.Module):
    """One megatron-core TransformerLayer, batch-first outside. Built whole (tensor parallel 1, so every
    process initialises the same weights); ``split_tensor_parallel`` rebuilds it over a replica's group."""

    def __init__(self, config: Any, layer_number: int):
        super().__init__()
        self.config, self.layer_number = config, layer_number
        self.layer = _local_layer(config, layer_number)

    def split_tensor_parallel(self, group: Any) -> None:
        """Rebuild the layer with megatron-core's own tensor-parallel layers over ``group`` (column-parallel
        QKV and first MLP matrix, row-parallel output projections; norms and row-parallel biases whole) and
        copy this rank's part of every weight into it. A tensor that shrank along one dim is a shard: the
        fused SwiGLU input matrix [gate; up] is two blocks, each split on its own (megatron's layout)."""

        from megatron.core.process_groups_config import ProcessGroupCollection

        pgs = ProcessGroupCollection.use_mpu_process_groups()
        pgs.tp = group
        with torch.random.fork_rng(devices=[]):  # the rebuild draws no numbers from the user's stream
            config = dataclasses.replace(self.config, perform_initialization=False)
            split = _local_layer(config, self.layer_number, pgs)
        whole = dict(self.layer.named_parameters())
        n, r = dist.get_world_size(group), dist.get_rank(group)
        with torch.no_grad():
            for name, p in split.named_parameters():
                w = whole[name]
                p.data = p.data.to(w.device, w.dtype)
                dims = [d for d in range(w.dim()) if w.shape[d] != p.shape[d]]
                if not dims:
                    p.copy_(w)
                    continue
                parts = 2 if name.endswith("linear_fc1.weight") or name.endswith("linear_fc1.bias") else 1
                parts = parts if self.config.gated_linear_unit else 1
                d = dims[0]
                p.copy_(torch.cat([b.chunk(n, dim=d)[r] for b in w.chunk(parts, dim=d)], dim=d))
                mark_split(p, group, d, parts)
        self.layer = split

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
        raise ValueError(f"config.tensor_model_parallel_size: build the layers whole (1); the plan's "
                         f"tensor_parallel splits them per stage, got {config.tensor_model_parallel_size}")
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
