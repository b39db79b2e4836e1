"""hethub's planning package: records, cost model, planner, simulator.

Pure Python + numpy/PuLP/HiGHS: it never imports torch, deepspeed or triton
(a test checks it), so planning runs on a laptop in milliseconds.
"""
from .errors import InfeasibleError, InputError, print_error
from .records import (Cluster, DeviceType, LayerInfo, LayerProfile, ModelConfig, Network, Node, Plan, Predicted,
                      Profile, Replica, SolverInfo, Stage, builtin_device_type, builtin_model, load_cluster,
                      load_plan, load_profile)
from .loaders import load_model

__all__ = ["InputError", "InfeasibleError", "print_error", "Cluster", "DeviceType", "LayerInfo", "LayerProfile", "ModelConfig",
           "Network", "Node", "Plan", "Predicted", "Profile", "Replica", "SolverInfo", "Stage",
           "builtin_device_type", "builtin_model", "load_cluster", "load_model", "load_plan", "load_profile"]
