"""Accelerator peaks that turn throughput into model FLOPs utilisation (MFU).

Torch-free on purpose: `pipeline.config` reads the default peak without loading torch.
"""

# NVIDIA H100 / H200 SXM dense bf16 peak per device (no sparsity): the default denominator of
# `pipeline.models.flops.estimate_mfu` and of the config's `tracking.peak_tflops`.
H100_BF16_PEAK_FLOPS = 989e12
