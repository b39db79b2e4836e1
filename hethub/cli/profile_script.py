"""``hethub profile --script train.py --device-type T -o DIR [--] [script args]``: a model hethub has never seen,
measured from the user's own training script.

The script runs in this process in capture mode (``hethub.runtime.capture``) until its engine's first step, which
hands over its layers, its loss and its first micro-batch. Each layer is then measured on this device, in order,
on the input the layers before it produce from that micro-batch: forward and backward (the last layer with the
loss after it), the backward split in its two passes (zb-h1, zb-v), the bytes autograd keeps for its backward,
the bytes of its input (what a recomputing stage keeps instead) and of its output (what crosses a stage
boundary after it), its parameters. ``DIR/model.json`` is the layer list (``architecture: measured``, named with
a digest of the layers: a profile of another version of the model does not apply to it) and ``DIR/T.json`` the
profile; ``hethub plan --model DIR/model.json --profiles DIR`` plans it with no transformer assumption, once every
device type of the cluster has a profile (the same command on each machine, into the same folder).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import runpy
import socket
import sys
import warnings
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..emulated.slowdown import SlowDown
from ..partitioner.errors import InputError
from ..partitioner.outputs import write_atomic
from ..partitioner.records import LayerProfile, MeasuredLayer, ModelConfig, Profile
from ..runtime import capture
from ..runtime.activations import ActivationMeter
from . import profiler
from .profiler import _MEASURED, local_device, measure_layer, measure_split, measure_steady, training_precision


def run_until_first_step(script: str, script_args: list[str], micro_batch: int) -> capture.Captured:
    """Run ``script`` as ``__main__`` with ``script_args`` until its first step (``capture.Captured``)."""
    if not os.path.isfile(script):
        raise InputError("--script", f"no such file {script[:100]!r}")
    env = {capture.CAPTURE_ENV: "1", capture.MICRO_BATCH_ENV: str(micro_batch), "RANK": "0", "LOCAL_RANK": "0",
           "WORLD_SIZE": "1"}
    saved_env, saved_argv, saved_path = {k: os.environ.get(k) for k in env}, sys.argv, list(sys.path)
    os.environ.update(env)
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    from ..runtime import routing  # lazy: needs deepspeed, which only the script path of the profiler uses
    routing.install()
    try:
        runpy.run_path(script, run_name="__main__")
    except capture.Captured as got:
        return got
    except SystemExit as exc:
        raise InputError("--script", f"{script[:100]} exited ({exc.code}) before its first train_batch") from None
    except Exception as exc:  # noqa: BLE001 - the user's script: whatever it raised, said in one line
        raise InputError("--script", f"{script[:100]} failed before its first train_batch: {type(exc).__name__}: "
                                     f"{str(exc).splitlines()[0][:200] if str(exc) else ''}") from None
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    raise InputError("--script", f"{script[:100]} ended without a train_batch (hethub profile measures the layers "
                                 f"its engine would train, at its first step)")


def _split_batch(batch: Any) -> tuple[Any, Any]:
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise InputError("--script", f"its data yields {type(batch).__name__}, not (inputs, labels) as a pipeline "
                                 f"engine reads them")


def _bytes(x: Any) -> int:
    if torch.is_tensor(x):
        return x.numel() * x.element_size()
    if isinstance(x, (tuple, list)):
        return sum(_bytes(t) for t in x)
    return 0


def _fresh(x: torch.Tensor, grad: bool) -> Callable[[], torch.Tensor]:
    """A new copy of ``x`` per call; one wanting a gradient is not a leaf, so that a layer writing into its input
    (``nn.ReLU(inplace=True)``) runs as in a pipeline, where the runtime hands such a layer a copy."""
    if not (grad and x.is_floating_point()):
        return lambda: x.detach().clone()
    return lambda: x.detach().clone().requires_grad_().clone()


def chain_activation_bytes(layers: list, loss: nn.Module, x: torch.Tensor, device: torch.device, dtype: str
                           ) -> list[int]:
    """Per layer, the bytes autograd keeps for backward that this layer adds when the layers run as one chain (the
    last with its loss): a storage two neighbours both save (a ReLU's output, the next Linear's input) counts
    once, with the first, as a stage's own meter counts it. Measured alone, each layer counted it again: the
    predicted peak of a CNN script's stages came out 1.65x what they held."""
    params = [p for m in layers if isinstance(m, nn.Module) for p in m.parameters()]
    meter = ActivationMeter(params)
    marks = []
    with meter, training_precision(device, dtype):
        y = x.detach().clone()
        for i, layer in enumerate(layers):
            y = loss(y) if i == len(layers) - 1 else layer(y)
            marks.append(meter.held)
    with torch.autocast(device.type, enabled=False):
        y.backward(torch.ones_like(y))
    return [b - a for a, b in zip([0, *marks[:-1]], marks)]


class _WithLoss(nn.Module):
    """The last layer and the loss after it: measured as one, as the last stage runs them."""

    def __init__(self, layer: nn.Module, loss_fn: Callable, labels: Any):
        super().__init__()
        self.layer, self.loss_fn, self.labels = layer, loss_fn, labels

    def forward(self, x):
        return self.loss_fn(self.layer(x), self.labels)


def measure_script_layers(got: capture.Captured, name: str, device_type: str, dtype: str, reps: int,
                          slowdown: float, progress: Optional[Callable[[int, int], None]] = None
                          ) -> tuple[ModelConfig, Profile]:
    """(model.json's model, the profile) of the captured layers on this device."""
    device = local_device()
    inputs, labels = _split_batch(got.batch)
    if not torch.is_tensor(inputs):
        raise InputError("--script", f"its inputs are {type(inputs).__name__}: hethub profile --script measures "
                                     f"layers that take one tensor")
    if got.loss_fn is None:
        raise InputError("--script", "no loss_fn (PipelineModule(loss_fn=...) or initialize(loss_fn=...))")
    layers = [m.to(device) if isinstance(m, nn.Module) else m for m in got.layers]
    labels = labels.to(device) if torch.is_tensor(labels) else labels
    rows = inputs.shape[0]
    xs = [inputs.to(device)]
    with torch.no_grad(), training_precision(device, dtype):
        for i, layer in enumerate(layers[:-1]):
            y = layer(xs[-1].clone())  # a copy: an in-place layer must not change the input kept for it
            if not torch.is_tensor(y):
                raise InputError("--script", f"layer {i} ({type(layer).__name__}) returns {type(y).__name__}: "
                                             f"hethub profile --script measures layers with one tensor output")
            xs.append(y)
    chain = chain_activation_bytes(layers, _WithLoss(layers[-1], got.loss_fn, labels), xs[0], device, dtype)
    measured, rows_out = [], []
    for i, layer in enumerate(layers):
        last = i == len(layers) - 1
        module = _WithLoss(layer, got.loss_fn, labels) if last else layer
        slowed = SlowDown(module, slowdown) if slowdown != 1.0 else module
        make_input = _fresh(xs[i], grad=True)
        trainable = [p for p in layer.parameters() if p.requires_grad] if isinstance(layer, nn.Module) else []
        with training_precision(device, dtype):
            row = measure_steady(lambda: measure_layer(slowed, make_input, device, 2, reps))
            if trainable and i > 0:  # the first layer's input carries no gradient: its backward is never split
                with warnings.catch_warnings():  # the input pass adds to the (non-leaf) copy's .grad: unread here
                    warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
                    row.update(measure_split(slowed, make_input, device, 2, reps, slowdown))
        row["activation_bytes"] = chain[i]  # what the layer adds in a chain, not alone (chain_activation_bytes)
        rows_out.append(LayerProfile(index=i, kind="layer", **{k: row.get(k) for k in _MEASURED}))
        params = list(layer.parameters()) if isinstance(layer, nn.Module) else []
        measured.append(MeasuredLayer(
            name=f"{i}", kind=type(layer).__name__[:100], params=sum(p.numel() for p in params),
            trainable_params=sum(p.numel() for p in trainable), activation_bytes=row["activation_bytes"] / rows,
            input_bytes=_bytes(xs[i]) / rows, output_bytes=0.0 if last else _bytes(xs[i + 1]) / rows))
        if progress is not None:
            progress(i + 1, len(layers))
    digest = hashlib.sha256("".join(m.model_dump_json() for m in measured).encode()).hexdigest()[:10]
    model = ModelConfig(name=f"{name[:80]}-{digest}", architecture="measured", measured_layers=measured)
    profile = Profile(device_type=device_type, model=model, micro_batch_size=rows, dtype=dtype,
                      emulated_slowdown=slowdown, layers=rows_out, host=socket.gethostname())
    return model, profile


def profile_script(script: str, script_args: list[str], device_type: str, out_dir: str, micro_batch: int = 1,
                   dtype: str = "fp32", reps: int = 7, slowdown: float = 1.0) -> tuple[ModelConfig, Profile]:
    """Measure ``script``'s model on this device; write ``out_dir/model.json`` and ``out_dir/<device_type>.json``.
    A model.json already there must be this model's (another version of the script is refused, not replaced)."""
    got = run_until_first_step(script, script_args, micro_batch)
    name = os.path.splitext(os.path.basename(script))[0]
    model, profile = measure_script_layers(got, name, device_type, dtype, reps, slowdown)
    os.makedirs(out_dir, exist_ok=True)
    model_path = os.path.join(out_dir, "model.json")
    if os.path.exists(model_path):
        from ..partitioner.loaders import load_model  # lazy: only where a folder is shared by several runs
        there = load_model(model_path)
        if there.shape_key() != model.shape_key():
            raise InputError("-o", f"{model_path[:100]} holds another model ({there.name}, this script's is "
                                   f"{model.name}): profile into a folder of its own")
    else:
        write_atomic(model_path, model.to_json() + "\n", "-o")
    write_atomic(os.path.join(out_dir, f"{device_type}.json"), profile.to_json() + "\n", "-o")
    return model, profile


_DEVICE_TYPE_FILE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def cmd_profile(args: argparse.Namespace) -> int:
    """``hethub profile``: ``--script`` here, ``--model`` in ``profiler``."""
    if args.script is None:
        return profiler.cmd_profile(args)
    if not _DEVICE_TYPE_FILE.fullmatch(args.device_type):
        raise InputError("--device-type", f"with --script it names the profile file: letters, digits, '.', '_' and "
                                          f"'-', got {args.device_type[:60]!r}")
    if args.tensor_parallel != 1 or args.links:
        raise InputError("--script", "a measured model is profiled on one device (no --tensor-parallel, no --links)")
    out_dir = args.output or "profile"
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise InputError("-o", f"{out_dir[:100]!r} is a file; with --script -o names a folder")
    script_args = args.script_args[1:] if args.script_args[:1] == ["--"] else args.script_args
    dtype = args.dtype or ("bf16" if torch.cuda.is_available() else "fp32")
    model, prof = profile_script(args.script, script_args, args.device_type, out_dir, args.micro_batch_size, dtype,
                                 args.reps, args.emulate_slowdown)
    params = sum(m.params for m in model.measured_layers)
    print(f"wrote {os.path.join(out_dir, 'model.json')} ({model.name}: {len(model.measured_layers)} layers, "
          f"{params:,} parameters) and {os.path.join(out_dir, args.device_type + '.json')} (micro-batch "
          f"{prof.micro_batch_size}, {dtype}); forward+backward "
          f"{sum(l.forward_ms + l.backward_ms for l in prof.layers):.3f} ms per micro-batch")
    return 0
