"""Worker: does megatron-core accept hethub's Megatron export? (gloo, CPU)

usage: megatron_accept.py PLAN  -- prints "ok" or raises.
"""
import sys

import torch
import torch.distributed as dist

torch.set_num_threads(1)


def main():
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig

    from hethub.partitioner import load_plan
    from hethub.partitioner.megatron_export import export_megatron

    plan = load_plan(sys.argv[1])
    ex = export_megatron(plan)
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=ex.tensor_model_parallel_size,
                                             pipeline_model_parallel_size=ex.pipeline_model_parallel_size)
    m = plan.model
    cfg = TransformerConfig(num_layers=ex.num_layers, hidden_size=m.hidden_size,
                            num_attention_heads=m.num_attention_heads, ffn_hidden_size=m.ffn_hidden_size,
                            pipeline_model_parallel_size=ex.pipeline_model_parallel_size,
                            pipeline_model_parallel_layout=ex.layout, pipeline_dtype=torch.float32,
                            use_cpu_initialization=True)
    rank = dist.get_rank()
    stage = parallel_state.get_pipeline_model_parallel_rank()
    want_stage = ex.rank_order[rank][1]
    assert stage == want_stage, (rank, stage, want_stage)
    assert parallel_state.get_data_parallel_world_size() == ex.data_parallel_size
    first, last = plan.stages[stage].layers
    blocks = sum(1 for i in range(first, last) if 0 < i < m.num_planner_layers - 1)
    built = get_num_layers_to_build(cfg)
    assert built == blocks, (rank, built, blocks)
    # Creating a gloo group is not a synchronisation point: a rank that exits right after its last group can
    # reset a peer still connecting to it ("Connection reset by peer", seen once in CI). Meet before leaving.
    dist.barrier()
    dist.destroy_process_group()
    print("ok", rank, stage, built, flush=True)


if __name__ == "__main__":
    main()
