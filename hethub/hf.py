"""``hethub.hf``: the public import path of the Hugging Face adapter (``hethub.models.hf``), kept as users write it."""
from .models.hf import causal_lm_loss, from_config_folder, from_pretrained, model_config, pipeline_layers, tp_plan

__all__ = ["pipeline_layers", "causal_lm_loss", "model_config", "tp_plan", "from_pretrained", "from_config_folder"]
