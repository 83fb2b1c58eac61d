"""Scatter the keys/values of an iteration's new tokens into their KV pool slots."""
from __future__ import annotations

import torch


def kv_write_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hkv, D]; k_cache, v_cache: [S, Hkv, D]; slot_mapping: [T] slot of each token."""
    k_cache[slot_mapping] = k
    v_cache[slot_mapping] = v


def kv_write(k, v, k_cache, v_cache, slot_mapping) -> None:
    kv_write_ref(k, v, k_cache, v_cache, slot_mapping)
