"""Worker: one Adam step of hethub's GPT layers under a plan with ZeRO-1; saves this rank's optimizer-state bytes.

usage: zero_memory.py PLAN OUT
"""
import json
import os
import sys

import torch

torch.set_num_threads(1)


def main():
    import hethub
    from hethub.models.builtin import build_layers, counting_batches, lm_loss
    from hethub.partitioner import load_plan
    from hethub.runtime.zero import optimizer_state_bytes
    plan_path, out = sys.argv[1:3]
    m = load_plan(plan_path).model
    torch.manual_seed(0)
    engine, *_ = hethub.initialize(layers=build_layers(m), loss_fn=lm_loss, plan=plan_path,
                                   config={"zero_optimization": {"stage": 1}},
                                   optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-3))
    batches = counting_batches(0, engine.micro_batches, engine.plan.micro_batch_size, m.seq_length, m.vocab_size)
    engine.train_batch(iter(batches))
    with open(out.replace("{rank}", os.environ["RANK"]), "w") as f:
        json.dump({"opt_bytes": optimizer_state_bytes(engine.optimizer)}, f)


if __name__ == "__main__":
    main()
