"""Worker: a tiny megatron-core GPT (local spec) trained under a hethub plan, or in one process.

usage: train_megatron.py PLAN OUT STEPS [single]
"""
import os
import sys

import torch
from torch import nn

torch.set_num_threads(1)
VOCAB, SEQ = 64, 8


def megatron_config():
    """Llama-style (SwiGLU, RMSNorm, 2 query groups for 4 heads): the layouts tensor parallelism must cut."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig
    return TransformerConfig(num_layers=3, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                             ffn_hidden_size=64, gated_linear_unit=True, activation_func=F.silu,
                             normalization="RMSNorm", use_cpu_initialization=True, hidden_dropout=0.0,
                             attention_dropout=0.0)


def batch(step, m, mb):
    g = torch.Generator().manual_seed(1000 * step + m)
    start = torch.randint(0, VOCAB, (mb, 1), generator=g)
    tokens = (start + torch.arange(SEQ + 1) * torch.randint(1, 3, (mb, 1), generator=g)) % VOCAB
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def main():
    plan_path, out, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    single = len(sys.argv) > 4 and sys.argv[4] == "single"
    from hethub.models.megatron import gpt_layers
    from hethub.models.builtin import lm_loss
    from hethub.partitioner import load_plan
    plan = load_plan(plan_path)
    mb, M, clip = plan.micro_batch_size, plan.num_micro_batches, 0.5
    torch.manual_seed(0)
    layers = gpt_layers(megatron_config(), VOCAB, SEQ)
    losses = []
    if single:
        model = nn.Sequential(*layers)
        opt = torch.optim.SGD(model.parameters(), lr=0.2)
        from train_stack import reference_step
        for step in range(steps):
            losses.append(reference_step(model, opt, [batch(step, m, mb) for m in range(M)], lm_loss, clip))
        params = {f"{i}.{k}": v for i, l in enumerate(layers) for k, v in l.state_dict().items()
                  if torch.is_tensor(v) and v.is_floating_point()}
    else:
        import hethub
        engine, *_ = hethub.initialize(layers=layers, loss_fn=lm_loss, config={"gradient_clipping": clip},
                                       plan=plan, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.2))
        for step in range(steps):
            losses.append(float(engine.train_batch(iter([batch(step, m, mb) for m in range(M)]))))
        a, b = engine.grid.stage.layers
        from hethub.runtime.tp import full, is_sharded, shard_of
        split = 0
        for i in range(a, b):
            for p in layers[i].parameters():
                split += is_sharded(p)  # and a checkpoint's whole tensor cuts back to exactly this shard
                assert torch.equal(shard_of(full(p), p), p.detach()), (i, p.shape)
        params = {f"{i}.{k}": full(v).detach().clone() for i in range(a, b)
                  for k, v in layers[i].state_dict(keep_vars=True).items()
                  if torch.is_tensor(v) and v.is_floating_point()}
    torch.save({"losses": torch.tensor(losses, dtype=torch.float64), "params": params,
                "split": torch.tensor(0 if single else split)},
               out.replace("{rank}", os.environ.get("RANK", "0")))


if __name__ == "__main__":
    main()
