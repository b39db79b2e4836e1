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

    def notes(self) -> list[str]:
        """What the flags do differently from the plan (Megatron sets these for every stage at once)."""
        out = []
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
               f"--global-batch-size {self.global_batch_size}"]
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


def export_megatron(plan: Plan) -> MegatronExport:
    """Megatron flags for a plan; a plan Megatron cannot express is refused with the reason."""
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
    stages = [_stage_layout(*s.layers, n) for s in plan.stages]
    if any("t" not in st for st in stages[1:-1]):
        raise InputError("plan.stages", "a middle stage without transformer layers cannot be expressed in "
                                        "Megatron's layout")
    layout = "|".join(stages)
    counts = [st.count("t") if "*" not in st else int(st.split("*")[1].rstrip("L")) for st in stages]
    middle = counts[1:-1]
    first_last = (counts[0], counts[-1]) if S > 1 and len(set(middle)) <= 1 else None
    order = []
    tp = plan.stages[0].tensor_parallel
    for r in range(S * dp * tp):  # Megatron's rank order: tensor-parallel fastest, then data, then pipeline
        s, rest = divmod(r, dp * tp)
        j, k = divmod(rest, tp)
        rep = plan.stages[s].replicas[j]
        order.append((r, s, j, rep.host, rep.group_slots(tp)[k], plan.stages[s].type_of(rep)))
    return MegatronExport(S, dp, plan.stages[0].tensor_parallel, plan.model.num_layers, layout, first_last,
                          plan.micro_batch_size // dp, plan.global_batch_size, order,
                          distributed_optimizer=any(plan.shards_optimizer(s) for s in plan.stages),
                          recompute_stages=tuple(s.index for s in plan.stages if s.recompute), dtype=plan.dtype)
