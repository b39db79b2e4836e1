"""``hethub export megatron``: the flags and rank order Megatron-core needs to run a plan (torch-free);
``hethub export hf``: a checkpoint written back as a Hugging Face folder (``hethub.models.hf_export``)."""
from __future__ import annotations

import argparse

from ..partitioner.errors import InputError
from ..partitioner.megatron_export import export_megatron
from ..partitioner.records import load_plan


def cmd_export(args: argparse.Namespace) -> int:
    if args.target == "hf":
        for flag, value in (("--model", args.model), ("-o", args.out)):
            if not value:
                raise InputError(flag, "export hf needs it: hethub export hf CHECKPOINT_DIR --model hf:FOLDER -o OUT")
        from ..models.hf_export import main_export_hf  # lazy: torch and transformers, for this target only
        return main_export_hf(args.plan, args.model, args.out, args.tag)
    for flag in ("model", "out", "tag"):
        if getattr(args, flag):
            raise InputError(f"--{flag}", "export megatron takes a plan only")
    ex = export_megatron(load_plan(args.plan))
    print(" \\\n".join(ex.flags()))
    for note in ex.notes():
        print(f"# {note}")
    print(f"# data-parallel size {ex.data_parallel_size} (world = {ex.pipeline_model_parallel_size} x "
          f"{ex.data_parallel_size}); per-rank micro-batch {ex.micro_batch_size}")
    if ex.first_last:
        print(f"# megatron-core without pipeline_model_parallel_layout: --decoder-first-pipeline-num-layers "
              f"{ex.first_last[0]} --decoder-last-pipeline-num-layers {ex.first_last[1]}")
    print("# launch ranks in this order (Megatron's rank order tp-cp-ep-dp-pp: rank r runs stage r // DP):")
    for r, s, j, host, slot, dtype in ex.rank_order:
        print(f"#   rank {r}: stage {s} replica {j} -> {host}:{slot} ({dtype})")
    return 0
