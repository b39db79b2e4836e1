"""``hethub export megatron``: the flags and rank order Megatron-core needs to run a plan (torch-free)."""
from __future__ import annotations

import argparse

from ..partitioner.megatron_export import export_megatron
from ..partitioner.records import load_plan


def cmd_export(args: argparse.Namespace) -> int:
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
