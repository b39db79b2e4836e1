"""A DeepSpeed pipeline training script, DeepSpeed's tutorial shape, that never mentions hethub.

Under a hethub plan it runs unchanged (each rank builds only the layers the plan gives it, in the plan's stages
and widths):

    hethub launch --hetero-plan tiny.json --local examples/deepspeed_pipeline.py \\
        --deepspeed_config examples/ds_config.json --steps 3

The model is a small GPT described with LayerSpecs (an embedding, --layers transformer blocks, a head): the
sizes default to the built-in `gpt-tiny`, which `hethub plan --model gpt-tiny` prices, so that layer i of this
list is planner layer i of the plan.
"""
import argparse

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.pipe import LayerSpec, PipelineModule
from torch import nn
from torch.utils.data import TensorDataset


class Embedding(nn.Module):
    def __init__(self, vocab: int, hidden: int, seq: int):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)

    def forward(self, ids):
        return self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))


class Head(nn.Module):
    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.norm, self.out = nn.LayerNorm(hidden), nn.Linear(hidden, vocab)

    def forward(self, x):
        return self.out(self.norm(x))


def lm_loss(logits, labels):
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--stages", type=int, default=1, help="PipelineModule(num_stages=...) under plain DeepSpeed")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=32)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    specs = [LayerSpec(Embedding, args.vocab, args.hidden, args.seq)]
    specs += [LayerSpec(nn.TransformerEncoderLayer, args.hidden, args.heads, 4 * args.hidden, dropout=0.0,
                        batch_first=True) for _ in range(args.layers)]
    specs += [LayerSpec(Head, args.hidden, args.vocab)]
    net = PipelineModule(layers=specs, loss_fn=lm_loss, num_stages=args.stages)
    ids = torch.randint(0, args.vocab, (256, args.seq + 1), generator=torch.Generator().manual_seed(1))
    data = TensorDataset(ids[:, :-1], ids[:, 1:])  # next-token prediction
    engine, _, _, _ = deepspeed.initialize(args=args, model=net,
                                           model_parameters=[p for p in net.parameters() if p.requires_grad],
                                           training_data=data)
    for step in range(1, args.steps + 1):
        loss = engine.train_batch()
        if dist.get_rank() == 0:
            print(f"step {step} loss {float(loss):.4f}", flush=True)


if __name__ == "__main__":
    main()
