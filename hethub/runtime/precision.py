"""The precision a run trains in: fp32, bf16 or fp16 autocast over fp32 weights, gradients and optimizer state.

Why hethub runs it rather than DeepSpeed's BF16_Optimizer / FP16_Optimizer: their flat-buffer gradient
bookkeeping assumes every replica of a stage holds the same samples and the same shapes, which a heterogeneous
plan breaks. Autocast over fp32 masters needs no bookkeeping at all; fp16 adds one thing, loss scaling, whose
policy is DeepSpeed's own (``DynamicLossScaler`` / ``LossScaler``, configured by the ds_config ``"fp16"`` keys
DeepSpeed documents). A step whose unscaled gradients are not finite on *any* rank is skipped on every rank,
so the stages never diverge.

The ds_config decides, as in DeepSpeed; a plan records the dtype it was priced in (``plan.dtype``), and a run in
another precision says once, on rank 0, that the plan's predictions assume the other one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from ..dsconfig import FP16Section, config_dtype
from ..partitioner.costmodel import DS_CONFIG_FOR
from ..partitioner.errors import InputError
from ..partitioner.records import Plan

AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Precision:
    dtype: str  # "fp32" | "bf16" | "fp16"
    fp16: FP16Section

    @property
    def autocast_dtype(self) -> Optional[torch.dtype]:
        return AUTOCAST[self.dtype]

    @property
    def wire(self) -> Optional[str]:
        """The wire dtype of a boundary the plan gives none: the 16-bit training dtype (what the cost model
        prices), else the tensors' own."""
        return None if self.dtype == "fp32" else self.dtype

    def loss_scaler(self):
        """DeepSpeed's scaler for fp16 (dynamic unless ``loss_scale`` fixes it); None otherwise. Built after
        ``torch.distributed`` starts: the dynamic one logs from rank 0."""
        if self.dtype != "fp16":
            return None
        f = self.fp16
        if f.loss_scale > 0:
            return LossScaler(f.loss_scale)
        return DynamicLossScaler(init_scale=2.0 ** f.initial_scale_power, scale_window=f.loss_scale_window,
                                 min_scale=f.min_loss_scale, delayed_shift=f.hysteresis,
                                 consecutive_hysteresis=f.consecutive_hysteresis)


def precision_from_config(cfg: dict) -> Precision:
    """The run's precision from the ds_config's ``bf16`` / ``fp16`` sections (``dsconfig.config_dtype``); both are
    removed from ``cfg``, since DeepSpeed must not build its own optimizer wrappers."""
    dtype, fp16 = config_dtype(cfg)
    cfg.pop("bf16", None)
    cfg.pop("fp16", None)
    return Precision(dtype, fp16)


def plan_dtype_note(plan: Plan, precision: Precision) -> Optional[str]:
    """A line for rank 0 when the run's precision is not the one the plan was priced in (None when it is)."""
    if plan.dtype is None or plan.dtype == precision.dtype:
        return None
    return (f"hethub: note: the plan was priced in {plan.dtype} (plan.dtype) and this run trains in "
            f"{precision.dtype}: its predicted times assume {plan.dtype} (ds_config {DS_CONFIG_FOR[plan.dtype]} "
            f"trains in it)")


def check_device_dtype(precision: Precision, device: torch.device) -> None:
    """bf16 on a GPU without it (V100, T4) would run without tensor cores at a fraction of the plan's speed."""
    if precision.dtype == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported(
            including_emulation=False):
        raise InputError("config.bf16.enabled", f"{torch.cuda.get_device_name(device)} has no bf16: train in fp16 "
                                                f"(\"fp16\": {{\"enabled\": true}}; plan with --dtype fp16)")


def norm_and_vote(tensors: list, counted: list[int]) -> torch.Tensor:
    """[sum of the squared norms of ``tensors[i]`` for i in ``counted``, how many of all ``tensors`` hold a
    non-finite value] in float64 on the host: a rank's share of the global gradient norm and its fp16 vote, from
    ``torch._foreach_norm`` (one kernel per dtype) and one device -> host copy. A tensor holding inf or nan has a
    non-finite norm, so the norms are the finiteness check too."""
    if not tensors:
        return torch.zeros(2, dtype=torch.float64)
    sq = torch.stack(torch._foreach_norm(tensors)).double().pow(2)
    counted_sq = sq[counted].sum() if counted else sq.new_zeros(())
    return torch.stack([counted_sq, (~torch.isfinite(sq)).sum().double()]).cpu()


def unscale(grads: list, scale: float) -> None:
    """Divide gradients by the loss scale in place (one foreach kernel per dtype; whether they are finite was
    voted on before, ``Gradients.step_sums``)."""
    if grads:
        torch._foreach_mul_(grads, 1.0 / scale)


_SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")  # DeepSpeed's, by name


def scaler_state(scaler) -> Optional[dict]:
    """What a checkpoint keeps of the loss scaler, so that a resumed fp16 run scales as the unbroken one."""
    if scaler is None:
        return None
    return {k: getattr(scaler, k) for k in _SCALER_FIELDS if hasattr(scaler, k)}


def load_scaler_state(scaler, state, where: str) -> None:
    """Restore ``scaler_state``; a checkpoint's numbers are checked (data from a file, not trusted)."""
    if scaler is None or state is None:
        return
    if not isinstance(state, dict):
        raise InputError("checkpoint", f"{where}: loss_scaler must be an object, got {type(state).__name__}")
    for k, v in state.items():
        ok = (k in _SCALER_FIELDS and hasattr(scaler, k) and isinstance(v, (int, float)) and not isinstance(v, bool)
              and abs(v) <= 2.0 ** 64 and (k != "cur_scale" or v > 0))
        if not ok:
            raise InputError("checkpoint", f"{where}: loss_scaler.{str(k)[:40]} = {str(v)[:40]} is not a valid "
                                           "loss-scaler value")
        setattr(scaler, k, v)
