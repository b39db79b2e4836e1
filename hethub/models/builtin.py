"""Real torch layers for a hethub ModelConfig: the profiler measures them, the example trains them.

The list order is the planner's layer list: embedding, one module per transformer block, head.
Llama blocks here use RMSNorm, grouped-query attention and SwiGLU; rotary position embeddings
are left out (their cost is a few elementwise ops, below what the profiler resolves).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..partitioner.records import ModelConfig


class Embedding(nn.Module):
    def __init__(self, m: ModelConfig):
        super().__init__()
        self.tok = nn.Embedding(m.vocab_size, m.hidden_size)
        self.pos = nn.Embedding(m.seq_length, m.hidden_size) if m.architecture == "gpt" else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        if self.pos is not None:
            x = x + self.pos(torch.arange(ids.shape[1], device=ids.device))
        return x


class Attention(nn.Module):
    """Causal self-attention with separate Q, K, V projections, so that splitting each column-wise across a
    tensor-parallel group gives every rank whole heads (a fused QKV matrix split by rows would not). The head
    count is read from the projections' output, so the same code runs whole or tensor-parallel."""

    def __init__(self, m: ModelConfig):
        super().__init__()
        self.head_dim = m.hidden_size // m.num_attention_heads
        bias = m.architecture == "gpt"
        kv = m.kv_heads * self.head_dim
        self.q = nn.Linear(m.hidden_size, m.hidden_size, bias=bias)
        self.k = nn.Linear(m.hidden_size, kv, bias=bias)
        self.v = nn.Linear(m.hidden_size, kv, bias=bias)
        self.proj = nn.Linear(m.hidden_size, m.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        if k.shape[1] != q.shape[1]:  # grouped-query attention
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, m: ModelConfig):
        super().__init__()
        norm = (lambda: nn.RMSNorm(m.hidden_size)) if m.architecture == "llama" else (lambda: nn.LayerNorm(m.hidden_size))
        self.norm1, self.norm2 = norm(), norm()
        self.attn = Attention(m)
        self.llama = m.architecture == "llama"
        if self.llama:  # SwiGLU; gate and up apart for the same reason as Q, K, V
            self.gate = nn.Linear(m.hidden_size, m.ffn_hidden_size, bias=False)
            self.up = nn.Linear(m.hidden_size, m.ffn_hidden_size, bias=False)
            self.down = nn.Linear(m.ffn_hidden_size, m.hidden_size, bias=False)
        else:
            self.fc1 = nn.Linear(m.hidden_size, m.ffn_hidden_size)
            self.fc2 = nn.Linear(m.ffn_hidden_size, m.hidden_size)

    # Megatron-style tensor parallelism of this block (hethub.runtime.tp): column-parallel Q, K, V and first MLP
    # matrices, row-parallel output projections; the norms stay whole on every rank.
    TP_PLAN = {"attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise", "attn.proj": "rowwise",
               "fc1": "colwise", "fc2": "rowwise", "gate": "colwise", "up": "colwise", "down": "rowwise"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        y = self.norm2(x)
        if self.llama:
            return x + self.down(F.silu(self.gate(y)) * self.up(y))
        return x + self.fc2(F.gelu(self.fc1(y)))


class Head(nn.Module):
    def __init__(self, m: ModelConfig):
        super().__init__()
        self.norm = nn.RMSNorm(m.hidden_size) if m.architecture == "llama" else nn.LayerNorm(m.hidden_size)
        self.out = nn.Linear(m.hidden_size, m.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def build_layers(m: ModelConfig) -> list[nn.Module]:
    """The model as the planner's layer list: [Embedding, Block x num_layers, Head]."""
    layers = [Embedding(m), *[Block(m) for _ in range(m.num_layers)], Head(m)]
    if m.tie_embeddings:  # the head's weight is the token embedding's (one Parameter: hethub.models.ties keeps it)
        layers[-1].out.weight = layers[0].tok.weight
    return layers


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the given samples (labels are already shifted)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def counting_batches(step: int, micro_batches: int, micro_batch_size: int, seq: int, vocab: int
                     ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Synthetic, learnable data, the same on every rank for a given step (seeded by the step): each
    sequence counts upwards modulo the vocabulary from a random start, so the next token is always
    (token + 1) % vocab and the loss falls quickly. No downloads."""
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(micro_batches):
        start = torch.randint(0, vocab, (micro_batch_size, 1), generator=g)
        tokens = (start + torch.arange(seq + 1)) % vocab
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out
