"""Plans for Megatron-LM / Megatron-core: what a Megatron user needs to run a hethub plan.

Megatron-core's ``parallel_state`` gives every pipeline stage the same data-parallel width and every
data-parallel rank the same micro-batch, and numbers ranks tensor-fastest, then data, then pipe
(its default order "tp-cp-ep-dp-pp"): with TP = 1, rank r runs stage r // DP. A plan with equal widths
and even splits maps onto that; stages may still sit on different device types and hold different
numbers of layers (``pipeline_model_parallel_layout``). Pure Python: no megatron import.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .errors import InputError
from .records import Plan
from .schedule_kinds import kind as schedule_kind


@dataclass(frozen=True)
class MegatronExport:
    pipeline_model_parallel_size: int
    data_parallel_size: int
    tensor_model_parallel_size: int
    num_layers: int
    layout: str  # pipeline_model_parallel_layout, e.g. "Et*3|t*4|t*3L"
    first_last: tuple[int, int] | None  # (first, last) stage decoder layers where the middle stages are even
    micro_batch_size: int  # per data-parallel rank
    global_batch_size: int
    rank_order: list[tuple[int, int, int, str, int, str]]  # megatron rank, stage, replica, host, slot, type
    distributed_optimizer: bool = False  # a stage shards its optimizer state (ZeRO-1) to fit
    recompute_stages: tuple[int, ...] = ()  # stages the plan recomputes activations on
    dtype: Optional[str] = None  # the plan's training dtype (None: a plan from before it was recorded)
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved-1f1b: Megatron's virtual pipeline)
    model_flags: tuple[str, ...] = ()  # the model's shape, as the plan was priced with it
    schedule: str = "1f1b"

    def notes(self) -> list[str]:
        """What the flags do differently from the plan (Megatron sets these for every stage at once)."""
        out = []
        if self.virtual_stages > 1:
            out.append(f"interleaved-1f1b: the layout's {self.pipeline_model_parallel_size} x {self.virtual_stages} "
                       "segments are Megatron's virtual pipeline (segment k runs on pipeline rank k mod "
                       f"{self.pipeline_model_parallel_size}, {self.virtual_stages} model chunks per rank)")
        if schedule_kind(self.schedule).split_backward:
            out.append("schedule zb-h1: Megatron runs these flags as 1F1B (the weight passes are not split off), "
                       "slower than the plan's prediction, which assumed zb-h1")
        if self.distributed_optimizer:
            out.append("--use-distributed-optimizer: the plan needs ZeRO-1 to fit; Megatron shards the optimizer "
                       "state on every stage")
        if self.recompute_stages and len(self.recompute_stages) < self.pipeline_model_parallel_size:
            out.append(f"full recompute: the plan recomputes on stages {list(self.recompute_stages)} only; Megatron "
                       "recomputes on every stage (same memory bound, slower on the others)")
        return out

    def flags(self) -> list[str]:
        out = [f"--pipeline-model-parallel-size {self.pipeline_model_parallel_size}",
               f"--tensor-model-parallel-size {self.tensor_model_parallel_size}",
               f"--num-layers {self.num_layers}",
               f"--pipeline-model-parallel-layout \"{self.layout}\"",
               f"--micro-batch-size {self.micro_batch_size}",
               f"--global-batch-size {self.global_batch_size}", *self.model_flags]
        if self.dtype in ("bf16", "fp16"):
            out.append(f"--{self.dtype}")
        if self.distributed_optimizer:
            out.append("--use-distributed-optimizer")
        if self.recompute_stages:
            out += ["--recompute-granularity full", "--recompute-method uniform", "--recompute-num-layers 1"]
        return out


def _stage_layout(first: int, last: int, n_planner: int) -> str:
    chars = "".join("E" if i == 0 else "L" if i == n_planner - 1 else "t" for i in range(first, last))
    blocks = chars.count("t")
    head = "E" if chars.startswith("E") else ""
    tail = "L" if chars.endswith("L") else ""
    middle = f"t*{blocks}" if blocks > 1 else ("t" if blocks == 1 else "")
    return head + middle + tail


def model_flags(plan: Plan) -> tuple[str, ...]:
    """Megatron-LM's flags for the model's shape the plan was priced with (hidden, FFN, heads, query groups,
    sequence, vocabulary; Llama's SwiGLU, RMSNorm, RoPE and bias-free linears)."""
    m = plan.model
    out = [f"--hidden-size {m.hidden_size}", f"--ffn-hidden-size {m.ffn_hidden_size}",
           f"--num-attention-heads {m.num_attention_heads}", f"--seq-length {m.seq_length}",
           f"--max-position-embeddings {m.seq_length}", f"--vocab-size {m.vocab_size}"]
    if m.num_key_value_heads and m.num_key_value_heads != m.num_attention_heads:
        out += ["--group-query-attention", f"--num-query-groups {m.num_key_value_heads}"]
    if m.architecture == "llama":
        out += ["--swiglu", "--normalization RMSNorm", "--position-embedding-type rope", "--disable-bias-linear"]
    if not m.tie_embeddings:
        out.append("--untie-embeddings-and-output-weights")
    return tuple(out)


def _check_ranks_node_contiguous(order: list) -> None:
    """torchrun numbers a node's ranks contiguously (node k holds ranks [k * n, (k + 1) * n)): Megatron's rank
    order must visit each host in one run, every host with as many ranks."""
    runs: list[list] = []
    for r, s, j, host, slot, _t in order:
        if runs and runs[-1][0] == host:
            runs[-1][1] += 1
        elif any(h == host for h, _ in runs):
            raise InputError("plan.stages", f"Megatron's rank {r} (stage {s}, replica {j}) is on host {host!r} again "
                                            "after other hosts: torchrun numbers each node's ranks contiguously, so "
                                            "no launch gives this order; re-plan with `hethub plan --equal-widths` "
                                            "(stages in host order) or run the plan with hethub's runtime")
        else:
            runs.append([host, 1])
    if len({n for _, n in runs}) > 1:
        raise InputError("plan.stages", f"ranks per host {[n for _, n in runs]} differ: torchrun starts the same "
                                        "number on every node")


def export_megatron(plan: Plan) -> MegatronExport:
    """Megatron flags for a plan; a plan Megatron cannot express is refused with the reason."""
    if plan.model.measured:
        raise InputError("plan.model", f"{plan.model.name!r} is a measured model (a script's own layers): Megatron "
                                       f"builds GPT-style models only; run it with hethub's runtime")
    if schedule_kind(plan.schedule).megatron is None:
        raise InputError("plan.schedule", f"{plan.schedule} (two chunks per group in a V) has no Megatron flags: re-plan with "
                                          "`--schedule 1f1b` or `interleaved-1f1b`, or run it with hethub's runtime")
    widths = {s.width for s in plan.stages}
    if len(widths) > 1:
        raise InputError("plan.stages", f"stage widths {[s.width for s in plan.stages]} differ; Megatron-core "
                                        f"gives every stage the same data-parallel width (re-plan with "
                                        f"`hethub plan --equal-widths`, or run this plan with hethub's runtime)")
    for s in plan.stages:
        if len({r.samples for r in s.replicas}) > 1:
            raise InputError(f"plan.stages[{s.index}].replicas", f"uneven sample split "
                                                                 f"{'+'.join(str(r.samples) for r in s.replicas)}; "
                                                                 "Megatron gives every data-parallel rank the same "
                                                                 "micro-batch (hethub's runtime runs this plan)")
        if s.tensor_parallel != plan.stages[0].tensor_parallel:
            raise InputError(f"plan.stages[{s.index}].tensor_parallel", "differs between stages; Megatron uses one "
                                                                        "tensor-parallel size")
    dp = widths.pop()
    S = plan.num_stages
    n = plan.model.num_planner_layers
    # every pipeline chunk in pipeline order: with interleaved-1f1b chunk k runs on rank k mod S, as in Megatron's
    # virtual pipeline, whose layout lists S x V segments in that order
    stages = [_stage_layout(c.first, c.last, n) for c in plan.pipeline]
    V = len(stages) // S
    if any("t" not in st for st in stages[1:-1]):
        raise InputError("plan.stages", "a middle stage without transformer layers cannot be expressed in "
                                        "Megatron's layout")
    layout = "|".join(stages)
    counts = [st.count("t") if "*" not in st else int(st.split("*")[1].rstrip("L")) for st in stages]
    middle = counts[1:-1]
    # the first/last-stage alternative to the layout: Megatron wants at least one decoder layer at each end
    first_last = (counts[0], counts[-1]) if V == 1 and S > 1 and len(set(middle)) <= 1 and min(counts[0],
                                                                                             counts[-1]) > 0 else None
    order = []
    tp = plan.stages[0].tensor_parallel
    for r in range(S * dp * tp):  # Megatron's rank order: tensor-parallel fastest, then data, then pipeline
        s, rest = divmod(r, dp * tp)
        j, k = divmod(rest, tp)
        rep = plan.stages[s].replicas[j]
        order.append((r, s, j, rep.host, rep.group_slots(tp)[k], plan.stages[s].type_of(rep)))
    _check_ranks_node_contiguous(order)
    return MegatronExport(S, dp, plan.stages[0].tensor_parallel, plan.model.num_layers, layout, first_last,
                          plan.micro_batch_size // dp, plan.global_batch_size, order,
                          distributed_optimizer=any(plan.shards_optimizer(s) for s in plan.stages),
                          recompute_stages=tuple(s.index for s in plan.stages if s.recompute), dtype=plan.dtype,
                          virtual_stages=V, model_flags=model_flags(plan), schedule=plan.schedule)
