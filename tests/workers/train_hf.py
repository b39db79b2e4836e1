"""Worker for the Hugging Face equivalence tests: a small transformers causal LM (random init, float64, no
dropout) trained with SGD and clipping under a plan, or in one process as Hugging Face runs it.

usage: train_hf.py PLAN OUT STEPS {gpt2|llama} [single] [--first K] [--load DIR] [--save DIR] [--pretrained DIR]
Trains steps [K, STEPS) (K = 0 unless given; with --load, resumed from DIR's checkpoint at step K); the model
starts from a pretrained folder's weights with --pretrained.
The reference: model(input_ids=ids, labels=ids).loss over the whole global batch, clip_grad_norm_, SGD.
"""
import os
import sys

import torch

torch.set_num_threads(1)
VOCAB, SEQ, LR, CLIP = 48, 8, 0.5, 0.3


def make_model(kind: str):
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(7)
    common = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=None)
    if kind == "gpt2":  # tied embedding and head (GPT-2's default)
        cfg = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=4, n_positions=SEQ, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0, **common)
        model = transformers.GPT2LMHeadModel(cfg)
    else:  # grouped-query attention (4 heads, 2 KV heads), rotary embeddings
        cfg = transformers.LlamaConfig(num_hidden_layers=3, hidden_size=32, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=64, max_position_embeddings=SEQ,
                                       **common)
        model = transformers.LlamaForCausalLM(cfg)
    return model.double()


def batch(step: int, rows: int) -> torch.Tensor:
    """The training batch is the same every step (the loss must fall); step -1 is the held-out batch."""
    return torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(500 if step >= 0 else 499))


def load(kind: str, pretrained=None):
    """The test's model: built here (seed 7), or a pretrained folder's weights (``hethub.hf.from_pretrained``)."""
    if pretrained is None:
        return make_model(kind)
    from hethub.hf import from_pretrained
    return from_pretrained(pretrained, dtype=torch.float64)


def reference(kind: str, mb: int, M: int, steps: int, pretrained=None) -> dict:
    """One process, as Hugging Face trains: losses, eval loss and every layer's weights (keys as hethub's)."""
    from hethub.models.hf import pipeline_layers
    model = load(kind, pretrained)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        ids = batch(step, mb * M)
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        ids = batch(-1, mb * 2)
        eval_loss = model(input_ids=ids, labels=ids).loss.item()
    params = {f"{i}.{k}": v for i, layer in enumerate(pipeline_layers(model)) for k, v in layer.state_dict().items()}
    return {"losses": torch.tensor(losses, dtype=torch.float64), "eval_loss": torch.tensor(eval_loss),
            "params": params}


def main():
    plan_path, out, steps, kind = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    argv = sys.argv[5:]
    out = out.replace("{rank}", os.environ.get("RANK", "0"))
    import hethub
    from hethub.models.hf import causal_lm_loss, pipeline_layers
    from hethub.partitioner import load_plan
    plan = load_plan(plan_path)
    mb, M = plan.micro_batch_size, plan.num_micro_batches
    if "single" in argv:
        torch.save(reference(kind, mb, M, steps), out)
        return
    model = load(kind, argv[argv.index("--pretrained") + 1] if "--pretrained" in argv else None)
    layers = pipeline_layers(model)
    from hethub.models.hf import tp_plan
    engine, *_ = hethub.initialize(layers=layers, loss_fn=causal_lm_loss, plan=plan, config={"gradient_clipping": CLIP},
                                   optimizer=lambda ps: torch.optim.SGD(ps, lr=LR),
                                   tp_plan=tp_plan(model) if any(s.tensor_parallel > 1 for s in plan.stages) else None)
    first_step = int(argv[argv.index("--first") + 1]) if "--first" in argv else 0
    if "--load" in argv:
        engine.load_checkpoint(argv[argv.index("--load") + 1])
        assert engine.global_steps == first_step, (engine.global_steps, first_step)
    losses = []
    for step in range(first_step, steps):
        ids = batch(step, mb * M)
        losses.append(float(engine.train_batch(iter([(x, x) for x in ids.split(mb)]))))
    if "--save" in argv:
        engine.save_checkpoint(argv[argv.index("--save") + 1])
    ids = batch(-1, mb * 2)
    eval_loss = float(engine.eval_batch(iter([(x, x) for x in ids.split(mb)]), num_micro_batches=2))
    mine = [i for a, b in engine.grid.stage.chunk_ranges for i in range(a, b)]  # every chunk's layers
    from hethub.runtime.tp import full
    params = {f"{i}.{k}": full(v).detach().clone() for i in mine for k, v in layers[i].state_dict().items()}
    torch.save({"losses": torch.tensor(losses, dtype=torch.float64), "eval_loss": torch.tensor(eval_loss),
                "params": params}, out)


if __name__ == "__main__":
    main()
