"""Model adapters: the layer lists hethub trains (``builtin``: hethub's own GPT/Llama; ``hf``: Hugging Face causal
LMs; ``megatron``: megatron-core blocks) and the tied weights found in any layer list (``ties``). They need nothing
of the runtime."""
