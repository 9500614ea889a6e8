"""What a benchmark ran on, for its JSON.

Ratios against peers move with the CPU, not only with either side's code: torch's default
fp32 GEMM (`F.linear`, MKL in the x86 wheels) and oneDNN with a packed weight (heron's
`linear`) run at rates whose ratio differs from one CPU to the next (MKL's fast paths are
Intel's), and a peer that multiplies through the one gains or loses against an engine that
multiplies through the other. So each result records the CPU and both rates, measured at a
decode-sized and a prefill-sized shape.
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields = {}
    for line in text.split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def gemm_gflops(rows: int, out_features: int = 2048, in_features: int = 512,
                seconds: float = 0.2) -> dict[str, float]:
    """fp32 GFLOP/s of ``[rows, in] @ [in, out]`` through `F.linear` and through heron's
    `linear` on a packed weight, each timed for about ``seconds`` after a warm-up."""
    from heron.core.ops.linear import linear, pack_weight

    x, w = torch.randn(rows, in_features), torch.randn(out_features, in_features)
    packed = pack_weight(w)
    rates = {}
    for name, run in (("F.linear", lambda: F.linear(x, w)),
                      ("onednn_packed", lambda: linear(x, packed))):
        for _ in range(3):
            run()
        count, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds:
            run()
            count += 1
        rates[name] = round(2 * rows * out_features * in_features * count / elapsed / 1e9, 1)
    return rates


def describe() -> dict:
    """The CPU (model, family and model numbers, the ISA extensions that pick GEMM paths),
    its core count, torch's threads and version, and `gemm_gflops` at 64 and 1024 rows."""
    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    return {"cpu": info.get("model name") or platform.processor() or platform.machine(),
            "vendor": info.get("vendor_id", ""),
            "family_model": f"{info.get('cpu family', '?')}/{info.get('model', '?')}",
            "isa": [f for f in _FLAGS if f in flags], "cpus": os.cpu_count(),
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "fp32_gemm_gflops": {"64x512x2048": gemm_gflops(64),
                                 "1024x512x2048": gemm_gflops(1024)}}
