"""A DeepSpeed pipeline training script in the tutorial's shape that never mentions hethub: LayerSpecs (a conv
front, a tied pair), PipelineModule(num_stages=S), deepspeed.init_distributed, deepspeed.initialize(args=...,
model=..., model_parameters=..., training_data=...), engine.train_batch() with no iterator, the ds_config's batch
keys and optimizer, engine.save_checkpoint. Run by DeepSpeed's launcher (the one-process reference, --stages 1) or by
`hethub launch --hetero-plan P` (unchanged). Saves every step's loss to OUT.RANK.

usage: ds_pipeline_script.py --out OUT --steps N --stages S --deepspeed_config CFG [--save DIR] [--local_rank R]
                             [--arch conv|mixed]   (mixed: an embedding, token and channel mixers, pooling)
"""
import argparse
import os

import deepspeed
import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn
from torch.utils.data import TensorDataset


class Flatten(nn.Module):
    def forward(self, x):
        return x.flatten(1)


def specs():
    return [LayerSpec(nn.Conv2d, 2, 4, 3, padding=1), LayerSpec(nn.ReLU, inplace=True),
            LayerSpec(nn.Conv2d, 4, 4, 3, padding=1), LayerSpec(nn.ReLU, inplace=True), LayerSpec(Flatten),
            TiedLayerSpec("proj", nn.Linear, 64, 64), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 64, 64),
            LayerSpec(nn.ReLU, inplace=True), TiedLayerSpec("proj", nn.Linear, 64, 64), LayerSpec(nn.Linear, 64, 5)]


class TokenMixer(nn.Module):
    """MLP-Mixer's token mixing: a Linear across the sequence, residual (not a transformer block)."""

    def __init__(self, seq: int):
        super().__init__()
        self.norm, self.mix = nn.LayerNorm(16), nn.Linear(seq, seq)

    def forward(self, x):
        return x + self.mix(self.norm(x).transpose(1, 2)).transpose(1, 2)


class GatedMLP(nn.Module):
    """A SiLU-gated channel MLP, residual."""

    def __init__(self):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(16, 32), nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return x + self.down(nn.functional.silu(self.gate(x)) * self.up(x))


class MeanPool(nn.Module):
    def forward(self, x):
        return x.mean(1)


def mixed_specs():
    """Non-transformer blocks of mixed kinds: an embedding, token and channel mixers, pooling, a classifier."""
    return [LayerSpec(nn.Embedding, 20, 16), LayerSpec(TokenMixer, 8), LayerSpec(GatedMLP), LayerSpec(TokenMixer, 8),
            LayerSpec(GatedMLP), LayerSpec(nn.LayerNorm, 16), LayerSpec(MeanPool), LayerSpec(nn.Linear, 16, 5)]


def dataset(arch: str, g: torch.Generator) -> TensorDataset:
    labels = torch.randint(0, 5, (96,), generator=g)
    if arch == "mixed":
        return TensorDataset(torch.randint(0, 20, (96, 8), generator=g), labels)
    return TensorDataset(torch.randn(96, 2, 4, 4, generator=g), labels)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", choices=["conv", "mixed"], default="conv")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--save", default=None, help="engine.save_checkpoint(DIR) at the end")
    parser.add_argument("--client-sgd", action="store_true", help="torch.optim.SGD(net.parameters()) built here")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(7)
    g = torch.Generator().manual_seed(11)
    data = dataset(args.arch, g)
    net = PipelineModule(layers=specs() if args.arch == "conv" else mixed_specs(), loss_fn=nn.CrossEntropyLoss(), num_stages=args.stages,
                         partition_method="parameters")
    opt = torch.optim.SGD(net.parameters(), lr=0.05) if args.client_sgd else None
    engine, _, _, _ = deepspeed.initialize(args=args, model=net, optimizer=opt,
                                           model_parameters=[p for p in net.parameters() if p.requires_grad],
                                           training_data=data)
    losses = [float(engine.train_batch()) for _ in range(args.steps)]
    if args.save:
        engine.save_checkpoint(args.save, tag="end")
    torch.save({"losses": losses, "engine": type(engine).__name__,
                "micro_batch": engine.train_micro_batch_size_per_gpu(),
                # where the rank ran (a plan's engine has a grid; plain DeepSpeed's does not say)
                "device_type": getattr(getattr(engine, "grid", None), "device_type", None),
                "local_rank": os.environ.get("LOCAL_RANK")},
               f"{args.out}.{os.environ.get('RANK', '0')}")


if __name__ == "__main__":
    main()
