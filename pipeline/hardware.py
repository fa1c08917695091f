"""Accelerator peaks that turn throughput into model FLOPs utilisation (MFU).

    peak_flops("NVIDIA H100 80GB HBM3", "bf16")           # 989e12: the H100 SXM dense bf16 peak
    peak_flops("NVIDIA A100-SXM4-80GB", "fp32", tf32=True) # 156e12: fp32 matmuls run as TF32
    peak_flops("cpu", "fp32")                              # None: no peak known, MFU is not logged

Torch-free on purpose: `pipeline.config` reads it without loading torch. Peaks are NVIDIA's datasheet
numbers per device, dense (no 2:4 sparsity), in FLOP/s: the 16-bit tensor-core peak for bf16 and fp16,
the TF32 tensor-core peak for fp32 matmuls with TF32 on, and the plain fp32 (CUDA-core) peak otherwise.
`tracking.peak_tflops` overrides the table (another accelerator, a power-capped part).
"""

from __future__ import annotations

from dataclasses import dataclass

# NVIDIA H100 / H200 SXM dense bf16 peak per device: the default denominator of `estimate_mfu`.
H100_BF16_PEAK_FLOPS = 989e12


@dataclass(frozen=True)
class Peaks:
    """Dense peaks of one accelerator, FLOP/s."""

    half: float  # bf16 / fp16 tensor cores
    tf32: float  # fp32 matmuls as TF32 on tensor cores
    fp32: float  # fp32 without TF32


_H100_SXM = Peaks(989e12, 494.7e12, 66.9e12)  # also H200 SXM and GH200: the same SM count and clocks
_H_NVL = Peaks(835.5e12, 417.5e12, 60e12)  # H100 NVL, H200 NVL
# (every word that must appear in torch.cuda.get_device_name(), lower case) -> peaks; first match wins,
# so the more specific names come first ("l40s" before "l40" before "l4").
PEAK_TABLE: tuple[tuple[tuple[str, ...], Peaks], ...] = (
    (("h100", "pcie"), Peaks(756e12, 378e12, 51.2e12)),
    (("h100", "nvl"), _H_NVL),
    (("h200", "nvl"), _H_NVL),
    (("h100",), _H100_SXM),
    (("h200",), _H100_SXM),
    (("gh200",), _H100_SXM),
    (("a100",), Peaks(312e12, 156e12, 19.5e12)),
    (("l40s",), Peaks(362e12, 183e12, 91.6e12)),
    (("l40",), Peaks(181e12, 90.5e12, 90.5e12)),
    (("l4",), Peaks(121e12, 60e12, 30.3e12)),
    (("v100",), Peaks(125e12, 15.7e12, 15.7e12)),  # no bf16 tensor cores and no TF32: the fp16 peak
)


def device_peaks(device_name: str) -> Peaks | None:
    """The table's peaks for a `torch.cuda.get_device_name()` string, or None when it is not listed."""
    words = device_name.lower().replace("-", " ").split()
    for keys, peaks in PEAK_TABLE:
        if all(k in words for k in keys):
            return peaks
    return None


def peak_flops(device_name: str, precision: str, tf32: bool = False) -> float | None:
    """The per-device dense peak (FLOP/s) that the matmuls of `precision` ("bf16", "fp16", "fp32") can
    reach on the named device, or None when the table does not know the device (CPUs included)."""
    peaks = device_peaks(device_name)
    if peaks is None:
        return None
    if precision in ("bf16", "fp16"):
        return peaks.half
    return peaks.tf32 if tf32 else peaks.fp32
