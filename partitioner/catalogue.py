"""Built-in device types and models.

Device figures are dense (no structured sparsity) peaks from each vendor's
datasheet; the source is named beside each entry. ``peak_tflops`` is keyed by
the dtype the tensor cores / matrix cores compute in, with FP32 accumulation
where the datasheet distinguishes it. A type without native bf16 (V100, T4)
lists fp16 only: bf16 work there is priced at its fp32 peak (no tensor cores), and
``hethub plan --dtype auto`` plans such a fleet in fp16.
"""
from __future__ import annotations

from typing import Any

# name -> fields of partitioner.records.DeviceType
DEVICE_TYPES: dict[str, dict[str, Any]] = {
    # NVIDIA A100 Tensor Core GPU datasheet (2021), SXM column: BF16/FP16 312 TFLOP/s dense,
    # TF32 156, FP32 19.5; A100 40GB HBM2 1,555 GB/s; A100 80GB HBM2e 2,039 GB/s.
    "A100-40GB": {"vendor": "nvidia", "peak_tflops": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
                  "memory_gib": 40, "memory_gbps": 1555},
    "A100-80GB": {"vendor": "nvidia", "peak_tflops": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
                  "memory_gib": 80, "memory_gbps": 2039},
    # NVIDIA H100 Tensor Core GPU datasheet, SXM column: BF16/FP16 1,979 TFLOP/s *with sparsity*
    # -> 989.4 dense; FP8 3,958 sparse -> 1,979 dense; TF32 494.7 dense; FP32 67; HBM3 3.35 TB/s.
    "H100-80GB": {"vendor": "nvidia",
                  "peak_tflops": {"bf16": 989.4, "fp16": 989.4, "fp8": 1979.0, "tf32": 494.7, "fp32": 67.0},
                  "memory_gib": 80, "memory_gbps": 3350},
    # NVIDIA H200 Tensor Core GPU datasheet, SXM column: same compute as H100 SXM; 141 GB HBM3e 4.8 TB/s.
    "H200": {"vendor": "nvidia",
             "peak_tflops": {"bf16": 989.4, "fp16": 989.4, "fp8": 1979.0, "tf32": 494.7, "fp32": 67.0},
             "memory_gib": 141, "memory_gbps": 4800},
    # NVIDIA V100 Tensor Core GPU datasheet, SXM2 column: tensor (FP16) 125 TFLOP/s, FP32 15.7;
    # HBM2 900 GB/s (16 GB and 32 GB variants). No bf16.
    "V100-16GB": {"vendor": "nvidia", "peak_tflops": {"fp16": 125.0, "fp32": 15.7},
                  "memory_gib": 16, "memory_gbps": 900},
    "V100-32GB": {"vendor": "nvidia", "peak_tflops": {"fp16": 125.0, "fp32": 15.7},
                  "memory_gib": 32, "memory_gbps": 900},
    # NVIDIA T4 datasheet: mixed precision (FP16/FP32) 65 TFLOP/s, FP32 8.1; GDDR6 320 GB/s, 16 GB.
    "T4": {"vendor": "nvidia", "peak_tflops": {"fp16": 65.0, "fp32": 8.1}, "memory_gib": 16, "memory_gbps": 320},
    # NVIDIA L4 datasheet: BF16/FP16 242 TFLOP/s with sparsity -> 121 dense; FP8 242 dense; FP32 30.3;
    # 24 GB GDDR6 300 GB/s.
    "L4": {"vendor": "nvidia", "peak_tflops": {"bf16": 121.0, "fp16": 121.0, "fp8": 242.0, "fp32": 30.3},
           "memory_gib": 24, "memory_gbps": 300},
    # NVIDIA A10 datasheet: BF16/FP16 125 TFLOP/s dense (250 sparse), FP32 31.2; 24 GB GDDR6 600 GB/s.
    "A10": {"vendor": "nvidia", "peak_tflops": {"bf16": 125.0, "fp16": 125.0, "fp32": 31.2},
            "memory_gib": 24, "memory_gbps": 600},
    # NVIDIA Ampere GA102 architecture whitepaper (RTX 3090): FP16/BF16 tensor with FP32 accumulate
    # 71 TFLOP/s dense; FP32 35.6; 24 GB GDDR6X 936 GB/s.
    "RTX-3090": {"vendor": "nvidia", "peak_tflops": {"bf16": 71.0, "fp16": 71.0, "fp32": 35.6},
                 "memory_gib": 24, "memory_gbps": 936},
    # NVIDIA Ada Lovelace architecture whitepaper (RTX 4090): FP16/BF16 tensor with FP32 accumulate
    # 165.2 TFLOP/s dense; FP8 330.3 dense (FP32 accumulate); FP32 82.6; 24 GB GDDR6X 1,008 GB/s.
    "RTX-4090": {"vendor": "nvidia", "peak_tflops": {"bf16": 165.2, "fp16": 165.2, "fp8": 330.3, "fp32": 82.6},
                 "memory_gib": 24, "memory_gbps": 1008},
    # AMD Instinct MI250X datasheet (OAM, both GCDs as one device): FP16/BF16 383 TFLOP/s, FP32 matrix 95.7;
    # 128 GB HBM2e 3.2 TB/s.
    "MI250X": {"vendor": "amd", "peak_tflops": {"bf16": 383.0, "fp16": 383.0, "fp32": 95.7},
               "memory_gib": 128, "memory_gbps": 3277},
    # AMD Instinct MI300X datasheet: FP16/BF16 1,307.4 TFLOP/s dense, FP8 2,614.9 dense, FP32 matrix 163.4;
    # 192 GB HBM3 5.3 TB/s.
    "MI300X": {"vendor": "amd", "peak_tflops": {"bf16": 1307.4, "fp16": 1307.4, "fp8": 2614.9, "fp32": 163.4},
               "memory_gib": 192, "memory_gbps": 5300},
}

# name -> fields of partitioner.records.ModelConfig
MODELS: dict[str, dict[str, Any]] = {
    # GPT-3 "Small" (Brown et al. 2020, table 2.1), context 2048.
    "gpt-125m": {"architecture": "gpt", "num_layers": 12, "hidden_size": 768, "num_attention_heads": 12,
                 "ffn_hidden_size": 3072, "vocab_size": 50257, "seq_length": 2048},
    # Megatron-LM's 1.3B GPT config (24 x 2048, 16 heads).
    "gpt-1.3b": {"architecture": "gpt", "num_layers": 24, "hidden_size": 2048, "num_attention_heads": 16,
                 "ffn_hidden_size": 8192, "vocab_size": 50257, "seq_length": 2048},
    # GPT-3 6.7B (Brown et al. 2020, table 2.1).
    "gpt-6.7b": {"architecture": "gpt", "num_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
                 "ffn_hidden_size": 16384, "vocab_size": 50257, "seq_length": 2048},
    # Llama 2 (Touvron et al. 2023, table 1 and the released configs).
    "llama-7b": {"architecture": "llama", "num_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
                 "ffn_hidden_size": 11008, "vocab_size": 32000, "seq_length": 4096},
    "llama-13b": {"architecture": "llama", "num_layers": 40, "hidden_size": 5120, "num_attention_heads": 40,
                  "ffn_hidden_size": 13824, "vocab_size": 32000, "seq_length": 4096},
    "llama-70b": {"architecture": "llama", "num_layers": 80, "hidden_size": 8192, "num_attention_heads": 64,
                  "num_key_value_heads": 8, "ffn_hidden_size": 28672, "vocab_size": 32000, "seq_length": 4096},
    # Shaped like the HETHUB paper's Llama-140B run: llama-70b's width with twice the depth (~139B parameters).
    "llama-140b": {"architecture": "llama", "num_layers": 160, "hidden_size": 8192, "num_attention_heads": 64,
                   "num_key_value_heads": 8, "ffn_hidden_size": 28672, "vocab_size": 32000, "seq_length": 4096},
    # Tiny model for tests, the demo and CPU profiling.
    "gpt-tiny": {"architecture": "gpt", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
                 "ffn_hidden_size": 256, "vocab_size": 512, "seq_length": 32},
}
