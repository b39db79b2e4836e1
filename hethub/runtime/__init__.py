"""The runtime: DeepSpeed's pipeline engine under a hethub plan, as parts that each own one concern.

``startup`` (``hethub.initialize``: checks, then the parts in order) → ``grid`` (ranks and process groups) →
``transport`` (boundary tensors between stages of unequal width), ``gradients`` (data-parallel, tied and
tensor-parallel reduction, clipping, the ZeRO-1 step), ``executor`` (one rank's action list, the only place that
knows action kinds) → ``engine`` (the DeepSpeed adapter that delegates to them). ``checkpoint`` stores per layer
(``saving`` writes, in the background where asked); ``elastic`` re-plans at an elastic start.
"""
from .startup import add_config_arguments, initialize

__all__ = ["initialize", "add_config_arguments"]
