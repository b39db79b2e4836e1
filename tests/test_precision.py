"""The run's precision (hethub.runtime.precision): the ds_config's bf16/fp16 sections, DeepSpeed's loss-scale
policy and defaults, the scaler's state in checkpoints, and the note when a run trains in another dtype than
its plan was priced in. The training equivalence of each precision is in test_runtime.py."""
import pytest
import torch

from hethub.partitioner import InputError
from hethub.runtime.precision import (load_scaler_state, norm_and_vote, plan_dtype_note, precision_from_config,
                                      scaler_state, unscale)
from plans import CASES, stack_plan


def test_the_config_decides_and_hethub_takes_the_sections_from_deepspeed():
    cfg = {"fp16": {"enabled": True, "auto_cast": False}, "bf16": {"enabled": False}, "train_batch_size": 4}
    p = precision_from_config(cfg)
    assert (p.dtype, p.autocast_dtype) == ("fp16", torch.float16) and cfg == {"train_batch_size": 4}
    s = p.loss_scaler()  # DeepSpeed's defaults: dynamic from 2**16, window 1000, hysteresis 2, min 1
    assert (s.cur_scale, s.scale_window, s.delayed_shift, s.min_scale) == (2.0 ** 16, 1000, 2, 1.0)
    static = precision_from_config({"fp16": {"enabled": True, "loss_scale": 128}}).loss_scaler()
    assert static.cur_scale == 128 and not hasattr(static, "scale_window")
    assert precision_from_config({"bf16": {"enabled": True}}).loss_scaler() is None
    assert precision_from_config({}).dtype == "fp32"


def test_the_scalers_state_round_trips_and_a_bad_one_is_refused():
    a = precision_from_config({"fp16": {"enabled": True, "hysteresis": 1}}).loss_scaler()
    a.update_scale(False)
    a.cur_scale, a.last_overflow_iter = 1024.0, 3
    b = precision_from_config({"fp16": {"enabled": True}}).loss_scaler()
    load_scaler_state(b, scaler_state(a), "ckpt")
    assert scaler_state(b) == scaler_state(a)
    for bad in ({"cur_scale": 0}, {"cur_scale": "big"}, {"cur_scale": True}, {"scale_factor": 2.0}, [1]):
        with pytest.raises(InputError, match="ckpt"):
            load_scaler_state(b, bad, "ckpt")


def test_unscale_divides_in_place_and_the_vote_counts_non_finite_tensors():
    g = [torch.full((3,), 8.0), torch.tensor([2.0, float("inf")]), torch.tensor([3.0, 4.0], dtype=torch.float64)]
    unscale(g[:1], 4.0)
    assert torch.equal(g[0], torch.full((3,), 2.0))
    sq, bad = norm_and_vote(g, [0, 2]).tolist()
    assert sq == pytest.approx(12.0 + 25.0) and bad == 1  # only the counted tensors' squared norms; every tensor votes
    assert norm_and_vote(g[::2], []).tolist() == [0.0, 0.0] and norm_and_vote([], [0]).tolist() == [0.0, 0.0]


def test_a_run_in_another_dtype_than_its_plan_says_so_once():
    plan = stack_plan(*CASES["1to1"])
    assert plan_dtype_note(plan, precision_from_config({})) is None  # a plan that records no dtype
    priced = plan.model_copy(update={"dtype": "bf16"})
    assert plan_dtype_note(priced, precision_from_config({"bf16": {"enabled": True}})) is None
    note = plan_dtype_note(priced, precision_from_config({}))
    assert "priced in bf16" in note and "trains in fp32" in note and '"bf16": {"enabled": true}' in note
