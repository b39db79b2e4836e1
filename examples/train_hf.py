"""Train a small Hugging Face causal LM (a local folder: its pretrained weights, or random init from its config.json)
under a hethub plan, on a text file; `hethub export hf` writes the checkpoint back as a Hugging Face folder.

    hethub plan --cluster examples/cluster.yaml --model hf:examples/hf-gpt2-tiny --seq-length 64 \
        --global-batch 16 -o plan.json
    hethub launch --hetero-plan plan.json examples/train_hf.py --model examples/hf-gpt2-tiny --text README.md \
        --save ckpt
    hethub export hf ckpt --model hf:examples/hf-gpt2-tiny -o gpt2-trained

The model comes from ``transformers`` (GPT-2, Llama, Mistral, Qwen2: ``from_pretrained`` where the folder holds
safetensors weights, else ``AutoModelForCausalLM.from_config``; local files only, nothing downloaded) and is cut into hethub's layers by ``hethub.hf.pipeline_layers``; GPT-2's tied
embedding/head stays tied across stages. Tokens: the file's bytes (modulo the vocabulary), since no
tokenizer is assumed to be available locally. Step k reads the global batch of sequences that starts
k batches into the file (wrapping around), the same under any plan.
"""
import argparse
import json
import os
import time

import torch

import hethub
from hethub.partitioner import InputError, load_plan, print_error


def fail(message: str) -> None:
    print_error(message)  # one write: the ranks share one stderr pipe
    raise SystemExit(2)


def load_model(path: str):
    """The folder's pretrained weights where it has them (``hethub.hf.from_pretrained``: local safetensors),
    else ``AutoModelForCausalLM.from_config`` of its config.json, random init."""
    from hethub.hf import from_config_folder, from_pretrained
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    pretrained = any(name.endswith(".safetensors") for name in os.listdir(folder)) if os.path.isdir(folder) else False
    try:
        return from_pretrained(folder) if pretrained else from_config_folder(folder)
    except InputError as exc:
        fail(str(exc))


def text_tokens(path: str, vocab: int) -> torch.Tensor:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        fail(f"--text: cannot read {path[:100]!r} ({exc.strerror})")
    if not data:
        fail(f"--text: {path[:100]!r} is empty")
    return torch.tensor(list(data), dtype=torch.int64) % vocab


def batch(tokens: torch.Tensor, step: int, rows: int, seq: int) -> torch.Tensor:
    """The step's rows x seq token ids, read from the file at (step x rows x seq), wrapping around."""
    start = step * rows * seq
    idx = (start + torch.arange(rows * seq)) % tokens.numel()
    return tokens[idx].view(rows, seq)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    hethub.add_config_arguments(parser)
    parser.add_argument("--model", required=True, help="a config.json, or the folder holding one")
    parser.add_argument("--text", required=True, help="training text (its bytes are the tokens)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--save", metavar="DIR", help="save a checkpoint there at the end (`hethub export hf DIR "
                                                      "--model hf:MODEL -o OUT` makes it a Hugging Face folder)")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.hetero_plan is None:
        fail("--hetero-plan: required (make one with `hethub plan --model hf:CONFIG`)")
    try:
        plan = load_plan(args.hetero_plan)
    except InputError as exc:
        fail(str(exc))
    from hethub.models.hf import causal_lm_loss, model_config, pipeline_layers
    torch.manual_seed(0)  # every rank builds the same initial weights
    model = load_model(args.model)
    try:
        layers = pipeline_layers(model)
        mine = model_config(model, seq_length=plan.model.seq_length)
    except ValueError as exc:
        fail(str(exc))
    for key in ("num_layers", "hidden_size", "vocab_size"):
        if getattr(mine, key) != getattr(plan.model, key):
            fail(f"--model: {key} is {getattr(mine, key)}, the plan's model has {getattr(plan.model, key)}")
    tokens = text_tokens(args.text, mine.vocab_size)
    engine, *_ = hethub.initialize(layers=layers, loss_fn=causal_lm_loss, plan=plan, args=args,
                                   optimizer=lambda ps: torch.optim.AdamW(ps, lr=args.lr))
    rank, mb, seq = int(os.environ.get("RANK", "0")), plan.micro_batch_size, plan.model.seq_length
    for step in range(engine.global_steps, args.steps):
        ids = batch(tokens, step, mb * plan.num_micro_batches, seq)
        t0 = time.perf_counter()
        loss = float(engine.train_batch(iter([(x, x) for x in ids.split(mb)])))
        if rank == 0:
            print(json.dumps({"step": step, "loss": round(loss, 4), "ms": round((time.perf_counter() - t0) * 1e3, 1)}),
                  flush=True)
    if args.save:
        engine.save_checkpoint(args.save)


if __name__ == "__main__":
    main()
