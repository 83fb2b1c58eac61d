"""KV cache tensors whose blocks can be lent to fine-tuning and taken back.

A training step needs memory for its activations; the KV pool holds nearly all of the
GPU's. On CUDA each layer's key and value tensors are built on the driver's virtual memory:
one reserved address range per tensor, backed by physical chunks mapped into it. Lending
blocks unmaps (and frees) the physical chunks behind them in every tensor, so the caching
allocator can use that memory for the training step; afterwards the chunks are created and
mapped again at the same addresses. The tensors never move, so captured CUDA graphs stay
valid. Only free blocks are lent (the scheduler's KV manager decides which: a run at the
end of the lendable range), and a block that comes back is zeroed, as the pool started.

The lendable range is counted in units of `unit_blocks` blocks (one chunk of every tensor).
The chunk that holds the scratch block (the last slot, where padding tokens write) is never
lent. Without CUDA (or when the driver refuses virtual memory) the tensors are plain torch
tensors and lending moves no memory; the scheduler's bookkeeping is the same.
"""
from __future__ import annotations

import ctypes
import logging
import math

import torch

logger = logging.getLogger("orca_serve.worker")
CHUNKS_PER_TENSOR = 64  # lending granularity: about 1/64 of the pool per unit


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("location", _Location), ("win32HandleMetaData", ctypes.c_void_p),
                ("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class _Driver:
    """The few CUDA driver calls of virtual memory management (libcuda through ctypes)."""

    def __init__(self, device: int):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.prop = _AllocationProp(type=1, location=_Location(type=1, id=device))  # pinned, device
        self.access = _AccessDesc(location=_Location(type=1, id=device), flags=3)  # read-write

    def call(self, name: str, *args) -> None:
        err = getattr(self.lib, name)(*args)
        if err != 0:
            raise RuntimeError(f"CUDA driver call {name} failed with error {err}")

    def granularity(self) -> int:
        size = ctypes.c_size_t()
        self.call("cuMemGetAllocationGranularity", ctypes.byref(size), ctypes.byref(self.prop), 0)
        return size.value

    def reserve(self, size: int) -> int:
        ptr = ctypes.c_uint64()
        self.call("cuMemAddressReserve", ctypes.byref(ptr), ctypes.c_size_t(size),
                  ctypes.c_size_t(0), ctypes.c_uint64(0), ctypes.c_uint64(0))
        return ptr.value

    def map(self, ptr: int, size: int) -> int:
        """Physical memory of `size` bytes created and mapped at ptr; its handle."""
        handle = ctypes.c_uint64()
        self.call("cuMemCreate", ctypes.byref(handle), ctypes.c_size_t(size),
                  ctypes.byref(self.prop), ctypes.c_uint64(0))
        try:
            self.call("cuMemMap", ctypes.c_uint64(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0),
                      handle, ctypes.c_uint64(0))
        except RuntimeError:
            self.call("cuMemRelease", handle)
            raise
        self.call("cuMemSetAccess", ctypes.c_uint64(ptr), ctypes.c_size_t(size),
                  ctypes.byref(self.access), ctypes.c_size_t(1))
        return handle.value

    def unmap(self, ptr: int, size: int, handle: int) -> None:
        self.call("cuMemUnmap", ctypes.c_uint64(ptr), ctypes.c_size_t(size))
        self.call("cuMemRelease", ctypes.c_uint64(handle))

    def free(self, ptr: int, size: int) -> None:
        self.call("cuMemAddressFree", ctypes.c_uint64(ptr), ctypes.c_size_t(size))


class _Array:
    """A device pointer as __cuda_array_interface__, for torch.as_tensor (no copy)."""

    def __init__(self, ptr: int, size: int):
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1",
                                         "data": (ptr, False), "version": 3, "strides": None}


class KVMemory:
    """The KV pool's tensors: `tensors[layer] = (keys, values)`, each of `shape`."""

    def __init__(self, num_layers: int, shape: tuple[int, ...], block_size: int,
                 dtype: torch.dtype, device: str, lendable: bool = True):
        self.num_blocks = shape[0] // block_size - 1  # the last block is the scratch block
        self.block_size, self.num_lent = block_size, 0
        elem = torch.tensor([], dtype=dtype).element_size()
        block_bytes = math.prod(shape[1:]) * block_size * elem
        self.driver = None
        if torch.device(device).type == "cuda" and lendable:
            try:
                self._build_virtual(num_layers, shape, block_bytes, dtype)
                return
            except (OSError, RuntimeError, AttributeError) as e:
                logger.warning("KV cache without virtual memory (%s): fine-tuning cannot "
                               "borrow KV blocks", e)
                self._release_virtual()
        self.tensors = [(torch.zeros(shape, dtype=dtype, device=device),
                         torch.zeros(shape, dtype=dtype, device=device)) for _ in range(num_layers)]
        self.unit_blocks = max(1, self.num_blocks // CHUNKS_PER_TENSOR)
        self.unit_bytes = 0  # lending frees nothing
        self.lendable_units = self.num_blocks // self.unit_blocks

    def _build_virtual(self, num_layers, shape, block_bytes, dtype) -> None:
        self.ranges, self.handles = [], []
        self.driver = _Driver(torch.cuda.current_device())
        torch.cuda.synchronize()  # the primary context is current on this thread
        granularity = self.driver.granularity()
        base = math.lcm(granularity, block_bytes)
        size = (self.num_blocks + 1) * block_bytes
        self.chunk = base * max(1, round(size / CHUNKS_PER_TENSOR / base))
        num_chunks = -(-size // self.chunk)
        self.unit_blocks = self.chunk // block_bytes
        self.lendable_units = self.num_blocks * block_bytes // self.chunk  # below the scratch
        self.unit_bytes = self.chunk * 2 * num_layers
        # the last chunk (never lent: it holds the scratch block) only as large as needed
        tail = size - (num_chunks - 1) * self.chunk
        self.sizes = [self.chunk] * (num_chunks - 1) + [-(-tail // granularity) * granularity]
        views = []
        for _ in range(2 * num_layers):
            ptr = self.driver.reserve(num_chunks * self.chunk)
            self.ranges.append((ptr, num_chunks * self.chunk))
            self.handles.append([])
            for i, n in enumerate(self.sizes):
                self.handles[-1].append(self.driver.map(ptr + i * self.chunk, n))
            flat = torch.as_tensor(_Array(ptr, size), device="cuda")
            views.append(flat.zero_().view(dtype).view(shape))
        self.tensors = list(zip(views[0::2], views[1::2]))

    def lendable(self) -> tuple[int, int, int]:
        """(blocks per unit, units that may be lent, bytes one unit frees)."""
        return self.unit_blocks, self.lendable_units, self.unit_bytes

    @property
    def lent_bytes(self) -> int:
        return self.num_lent * self.unit_bytes

    def lend(self, units: int) -> None:
        """Free the memory of the last `units` lendable units (the scheduler uses none of
        their blocks until `take_back`); units lent already stay lent. Unit by unit from
        the end: if the driver fails midway, what was unmapped counts as lent."""
        if self.driver is not None and units > self.num_lent:
            torch.cuda.synchronize()  # nothing in flight may still touch them
            for i in reversed(range(self.lendable_units - units,
                                    self.lendable_units - self.num_lent)):
                self.num_lent = self.lendable_units - i
                for (ptr, _), handles in zip(self.ranges, self.handles):
                    if handles[i] is not None:
                        self.driver.unmap(ptr + i * self.chunk, self.chunk, handles[i])
                        handles[i] = None
        self.num_lent = max(self.num_lent, units)

    def take_back(self) -> None:
        """Map every unmapped unit again, zeroed, after the allocator's cache is emptied
        (what the training step left there). Raises when the device has no memory for
        them; the units mapped by then stay mapped, and a later call maps the rest."""
        if self.num_lent == 0:
            return
        if self.driver is not None:
            torch.cuda.empty_cache()
            for i in range(self.lendable_units - self.num_lent, self.lendable_units):
                for (ptr, _), handles in zip(self.ranges, self.handles):
                    if handles[i] is None:
                        handles[i] = self.driver.map(ptr + i * self.chunk, self.chunk)
                lo, hi = (n * self.unit_blocks * self.block_size for n in (i, i + 1))
                for k, v in self.tensors:  # (as bytes: an FP8 pool's too)
                    k[lo:hi].view(torch.uint8).zero_()
                    v[lo:hi].view(torch.uint8).zero_()
        self.num_lent = 0

    def free(self) -> None:
        """Release the device memory (the tensors must not be used after)."""
        self.tensors = []
        self._release_virtual()

    def _release_virtual(self) -> None:
        if self.driver is None or not hasattr(self, "ranges"):
            self.driver = None
            return
        torch.cuda.synchronize()
        for (ptr, size), handles in zip(self.ranges, self.handles):
            for i, h in enumerate(handles):
                if h is not None:
                    self.driver.unmap(ptr + i * self.chunk, self.sizes[i], h)
            self.driver.free(ptr, size)
        self.ranges, self.handles, self.driver = [], [], None
