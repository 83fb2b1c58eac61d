"""Measured ceilings of the GPU: device-to-device copy bandwidth and bf16 matmul rate.

Benchmarks report utilisation against these, measured in the same run, not datasheet values.
"""
from __future__ import annotations

import torch


def _time_ms(fn, warmup: int = 3, iters: int = 10) -> float:
    for _ in range(warmup):
        fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return sorted(times)[len(times) // 2]


def copy_bandwidth_gbs(num_bytes: int = 4 << 30) -> float:
    """Bytes read plus bytes written per second, GB/s, for a large device-to-device copy."""
    src = torch.randn(num_bytes // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * num_bytes / ms / 1e6


def matmul_tflops(n: int = 8192) -> float:
    """bf16 n x n x n matmul rate on random data, TFLOP/s."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = _time_ms(lambda: a @ b)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n ** 3 / ms / 1e9


def measure() -> dict:
    return {"gpu": torch.cuda.get_device_name(), "copy_gbs": copy_bandwidth_gbs(),
            "matmul_bf16_tflops": matmul_tflops()}
