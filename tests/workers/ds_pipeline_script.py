"""A DeepSpeed pipeline training script in the tutorial's shape that never mentions hethub: LayerSpecs (a conv
front, a tied pair), PipelineModule(num_stages=S), deepspeed.init_distributed, deepspeed.initialize(args=...,
model=..., model_parameters=..., training_data=...), engine.train_batch() with no iterator, the ds_config's batch
keys and optimizer, engine.save_checkpoint. Run by DeepSpeed's launcher (the one-process reference, --stages 1) or by
`hethub launch --hetero-plan P` (unchanged). Saves every step's loss to OUT.RANK.

usage: ds_pipeline_script.py --out OUT --steps N --stages S --deepspeed_config CFG [--save DIR] [--local_rank R]
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


def main():
    parser = argparse.ArgumentParser()
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
    data = TensorDataset(torch.randn(96, 2, 4, 4, generator=g), torch.randint(0, 5, (96,), generator=g))
    net = PipelineModule(layers=specs(), loss_fn=nn.CrossEntropyLoss(), num_stages=args.stages,
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
