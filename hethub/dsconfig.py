"""A ds_config read and checked against a plan without torch: what ``hethub launch`` checks before it starts
DeepSpeed's launcher, and what every rank checks again before its first collective.

Why torch-free: a configuration error found by the launcher is one line in a second; found by the ranks it came
after ~25 s of start-up, inside DeepSpeed's logs, once per rank.
"""
from __future__ import annotations

import json
import os
from typing import Optional, Union

from pydantic import ConfigDict, Field, field_validator, model_validator

from .partitioner.costmodel import DEFAULT_BUCKET_MB
from .partitioner.errors import InputError
from .partitioner.records import Plan, Record, parse_record, read_data_file

DEFAULT_TIMEOUT_S = 300
DEFAULT_JOIN_TIMEOUT_S = 600  # hosts are started one after another, by hand or by ssh (hethub.runtime.join)
MAX_SLOWDOWN = 1e4  # as `hethub profile --emulate-slowdown` allows: past it a factor is a typo


def load_config(config: Union[dict, str, None]) -> dict:
    if config is None:
        return {}
    if isinstance(config, dict):
        return json.loads(json.dumps(config))  # deep copy; we fill in batch keys
    data = read_data_file(str(config), "config")  # JSON (YAML also accepted)
    if not isinstance(data, dict):
        raise InputError("config", f"{config}: expected a JSON object, got {type(data).__name__}")
    return data


MIN_TIMEOUT_S, MAX_TIMEOUT_S = 1.0, 7 * 86400  # under a second no start-up finishes; past a week it is a typo
MIN_BUCKET_MB, MAX_BUCKET_MB = 1e-3, 65536.0  # 1 KiB (tests, tiny models) .. 64 GiB (one bucket for anything)


class HeteroSection(Record):
    """ds_config's ``"hetero"`` section, checked whole on every rank before any collective.

    Why: a misspelt key (``"timout_s"``) would otherwise be a setting silently ignored, and a bad value a
    traceback halfway through start-up; here either is one line naming ``config.hetero.<field>``.
    """
    plan: Optional[Union[str, dict]] = None  # plan.json, or the plan itself (overridden by plan= and --hetero-plan)
    schedule: Optional[str] = None  # a hand-edited schedule file (``hethub simulate --print-schedule``'s format)
    resume: Optional[str] = None  # load the newest complete checkpoint in this directory at initialize
    emulate_slowdown: Optional[dict[str, float]] = None  # {device type: k}: emulated heterogeneity (hethub.emulated.slowdown)
    timeout_s: float = Field(DEFAULT_TIMEOUT_S, ge=MIN_TIMEOUT_S, le=MAX_TIMEOUT_S)  # torch.distributed's, for every collective
    # how long the ranks that started wait for every other rank of the plan to start (hethub.runtime.join)
    join_timeout_s: float = Field(DEFAULT_JOIN_TIMEOUT_S, ge=MIN_TIMEOUT_S, le=MAX_TIMEOUT_S)
    # the data-parallel gradient all-reduce's bucket size (hethub.runtime.buckets; the cost model's default)
    bucket_mb: float = Field(DEFAULT_BUCKET_MB, ge=MIN_BUCKET_MB, le=MAX_BUCKET_MB)
    # The engine saves ``checkpoint_dir/global_step<k>`` every ``checkpoint_every`` steps by itself (0: never).
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = Field(0, ge=0, le=10 ** 9)
    # Those checkpoints are written by a thread while training goes on (hethub.runtime.saving); false: at the step.
    checkpoint_background: bool = True
    # Elastic start (hethub.runtime.elastic): the ranks present re-plan for themselves and resume from the newest
    # complete checkpoint in checkpoint_dir (``hethub launch --elastic`` sets it, and the two keys above).
    elastic: bool = False

    @model_validator(mode="after")
    def _elastic_needs_a_directory(self) -> "HeteroSection":
        if (self.elastic or self.checkpoint_every) and not self.checkpoint_dir:
            raise ValueError("checkpoint_dir: elastic runs and checkpoint_every need the checkpoint directory")
        return self

    @field_validator("emulate_slowdown")
    @classmethod
    def _slowdowns(cls, value: Optional[dict[str, float]]) -> Optional[dict[str, float]]:
        for name, k in (value or {}).items():
            if not 1.0 <= k <= MAX_SLOWDOWN:
                raise ValueError(f"{name}: must be in [1, {MAX_SLOWDOWN:g}], got {k!r}")
        return value


def hetero_section(config: dict) -> HeteroSection:
    """The checked ``"hetero"`` section of a ds_config dict (an absent section is all defaults)."""
    section = config.get("hetero")
    if section is None:
        section = {}
    if not isinstance(section, dict):
        raise InputError("config.hetero", f"expected an object of hethub's settings, got {type(section).__name__}")
    return parse_record(HeteroSection, {**launcher_settings(), **section}, "config.hetero")


# What ``hethub launch --elastic`` hands its workers (the ds_config's own keys win).
LAUNCH_ENV = {"HETHUB_ELASTIC": "elastic", "HETHUB_CHECKPOINT_DIR": "checkpoint_dir",
              "HETHUB_CHECKPOINT_EVERY": "checkpoint_every"}


def launcher_settings() -> dict:
    """The ``"hetero"`` keys the launcher set in the environment (checked with the section's own)."""
    return {key: os.environ[name] for name, key in LAUNCH_ENV.items() if os.environ.get(name)}


class FP16Section(Record):
    """ds_config's ``"fp16"`` section: DeepSpeed's keys and defaults (``loss_scale`` 0 = dynamic). Keys hethub
    has no use for (``auto_cast``, ...) are accepted and ignored, as DeepSpeed's own config would read them."""
    model_config = ConfigDict(frozen=True, extra="ignore")
    enabled: bool = False
    loss_scale: float = Field(0.0, ge=0, le=2.0 ** 64)
    initial_scale_power: int = Field(16, ge=0, le=64)
    loss_scale_window: int = Field(1000, ge=1, le=10 ** 9)
    hysteresis: int = Field(2, ge=1, le=10 ** 6)
    consecutive_hysteresis: bool = False
    min_loss_scale: float = Field(1.0, gt=0, le=2.0 ** 64)


def config_dtype(cfg: dict) -> tuple[str, FP16Section]:
    """The training dtype the ds_config's ``bf16`` / ``fp16`` sections ask for (checked: one line naming the field)."""
    bf16 = cfg.get("bf16", None) or {}
    if not isinstance(bf16, dict):
        raise InputError("config.bf16", f"expected an object like {{\"enabled\": true}}, got {bf16!r}"[:160])
    fp16 = parse_record(FP16Section, cfg.get("fp16", None) or {}, "config.fp16")
    if bf16.get("enabled") and fp16.enabled:
        raise InputError("config.fp16.enabled", "bf16 and fp16 are both enabled: train in one of them")
    return ("bf16" if bf16.get("enabled") else "fp16" if fp16.enabled else "fp32"), fp16


def check_batch_keys(plan: Plan, config: dict, ranks) -> None:
    """The ds_config's batch keys, where given, agree with the plan on each of ``ranks``."""
    for rank in ranks:
        stage_id, rep = plan.locate(rank)
        samples = plan.stages[stage_id].replicas[rep].samples
        # DeepSpeed's meaning: the micro-batch one pipeline step takes (the plan's, whatever the split), the
        # micro-batches per step, the global batch
        expected = {"train_batch_size": plan.global_batch_size, "gradient_accumulation_steps": plan.num_micro_batches,
                    "train_micro_batch_size_per_gpu": plan.micro_batch_size}
        for key, want in expected.items():
            if key in config and config[key] != want:
                hint = (": the plan's micro-batch, not one replica's share of it" if key == "train_micro_batch_size_per_gpu"
                        and config[key] == samples else "")
                raise InputError(f"config.{key}", f"must agree with the plan ({want}{hint}), "
                                                  f"got {str(config[key])[:60]}")


def check_zero(plan: Plan, config: dict) -> None:
    """ZeRO stage 0 or 1, and 1 where the plan's memory assumes it."""
    section = config.get("zero_optimization") or {}
    if not isinstance(section, dict):
        raise InputError("config.zero_optimization", f"expected an object like {{\"stage\": 1}}, got "
                                                     f"{str(section)[:60]}")
    zero = section.get("stage", 0)
    if zero not in (0, 1):
        raise InputError("config.zero_optimization.stage", f"hethub runs ZeRO stage 0 or 1 (stage 1 shards optimizer "
                                                           f"state over each stage's replicas); stages 2 and 3 are "
                                                           f"not supported, got {str(zero)[:40]}")
    if plan.zero1 and zero != 1:
        raise InputError("config.zero_optimization.stage", "the plan was made with --zero1 (its memory assumes "
                                                           "optimizer state sharded over each stage's replicas): set "
                                                           "\"zero_optimization\": {\"stage\": 1}")


def check_config(plan: Plan, config: dict, ranks=None) -> None:
    """Everything about a ds_config that can be checked against a plan before any process starts."""
    hetero_section(config)
    config_dtype(config)
    check_batch_keys(plan, config, range(plan.world_size) if ranks is None else ranks)
    check_zero(plan, config)

