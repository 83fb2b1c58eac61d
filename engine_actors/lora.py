"""LoRA adapters on the scheduler's side: which adapters exist, and which device slot holds
which adapter.

The registry checks an adapter once, when it is added (lora_files.py), and gives it a fresh
id: a request carries its adapter's info, and the id keys the request's prefix-cache entries
(an adapter loaded again under the same name never reuses the old one's KV). Workers hold
`max_loras` slots of weights; `LoRASlots` assigns adapters to slots on demand, evicts the
least recently used slot that no admitted request uses, and tells the workers what to load
through the step message (the weights read when the adapter was added). A request whose
adapter cannot get a slot waits; it is never refused for that.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import os

import ray

from engine_actors.lora_files import (AdapterInfo, LoRAError, check_tensors, read_adapter,
                                      read_weights)
from engine_actors.messages import Refusal


class LoRARegistry:
    """The adapters requests may name. `model`: the model's target_shapes, layer count and
    layers of experts, which every adapter's tensors are checked against (set once the
    engine has started)."""

    def __init__(self, max_rank: int, model: tuple[dict, int] | None = None):
        self.max_rank = max_rank
        self.model = model
        self.adapters: dict[str, AdapterInfo] = {}
        self._ids = itertools.count(1)

    def add(self, name: str, path: str, reserved: set[str] = frozenset()) -> AdapterInfo:
        self.check_name(name, reserved)
        return self.insert(self.read(name, path), reserved)

    def check_name(self, name: str, reserved: set[str] = frozenset()) -> None:
        if not name or name in reserved:
            raise LoRAError(f"{name!r} cannot name a LoRA adapter")
        if name in self.adapters:
            raise LoRAError(f"a LoRA adapter named {name!r} is already loaded")

    def read(self, name: str, path: str) -> AdapterInfo:
        """The adapter at `path`, checked, with its weights read (in any thread: nothing
        here changes); LoRAError naming what is wrong."""
        if self.model is None:
            raise RuntimeError("adapters are read once the model is known")
        info = read_adapter(name, path, self.max_rank, next(self._ids))
        data = read_weights(info)
        check_tensors(info, data, *self.model)
        # in the object store, the workers fetch it when they load a slot
        return dataclasses.replace(info, weights=ray.put(data) if ray.is_initialized() else data)

    def insert(self, info: AdapterInfo, reserved: set[str] = frozenset()) -> AdapterInfo:
        self.check_name(info.name, reserved)  # (another of that name may have come since)
        self.adapters[info.name] = info
        return info

    def remove(self, name: str) -> AdapterInfo:
        try:
            return self.adapters.pop(name)
        except KeyError:
            raise LoRAError(f"no LoRA adapter named {name!r} is loaded") from None


class LoRASlots:
    """Device slots of adapter weights: which adapter each holds, how many admitted requests
    use it, and the least recently used unused ones (evicted first)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.adapter: list[AdapterInfo | None] = [None] * num_slots
        self.refs = [0] * num_slots
        self._slot_of: dict[int, int] = {}  # adapter id -> slot
        self._unloaded: set[int] = set()  # ids unloaded while requests still use them
        self._unused: collections.OrderedDict[int, None] = collections.OrderedDict(
            (s, None) for s in range(num_slots))  # least recently used first

    def has_room_for(self, info: AdapterInfo, planned: set[int]) -> bool:
        """Can a request of `info` be admitted now, beside those of the adapters `planned`
        (ids) that this iteration's earlier picks start?"""
        if info.id in planned:
            return True
        slot = self._slot_of.get(info.id)
        if slot is None or self.refs[slot] == 0:  # it needs an unused slot to itself
            taken = sum(1 for i in planned
                        if (s := self._slot_of.get(i)) is None or self.refs[s] == 0)
            return len(self._unused) - taken > 0
        return True

    def acquire(self, info: AdapterInfo, keep: set[int] = frozenset()) -> tuple[int, bool]:
        """The slot of `info` for one more request, and whether the workers must load it
        there first (it was not resident). `keep`: adapter ids whose unused slots must not
        be evicted now (others of this iteration use them)."""
        slot = self._slot_of.get(info.id)
        load = slot is None
        if load:  # a free slot, or the least recently used one that is not kept
            slot = next(s for s in self._unused
                        if self.adapter[s] is None or self.adapter[s].id not in keep)
            del self._unused[slot]
            old = self.adapter[slot]
            if old is not None:
                del self._slot_of[old.id]
            self.adapter[slot] = info
            self._slot_of[info.id] = slot
        elif self.refs[slot] == 0:
            del self._unused[slot]
        self.refs[slot] += 1
        return slot, load

    def release(self, slot: int) -> None:
        self.refs[slot] -= 1
        if self.refs[slot] == 0:
            self._unused[slot] = None  # most recently used
            info = self.adapter[slot]
            if info is not None and info.id in self._unloaded:
                self._unloaded.discard(info.id)
                self._drop(slot)

    def forget(self, info: AdapterInfo) -> None:
        """`info` was unloaded: its slot goes first once unused. Until then it stays
        resident, and requests queued with it share it (they finish with it)."""
        slot = self._slot_of.get(info.id)
        if slot is None:
            return
        if self.refs[slot]:
            self._unloaded.add(info.id)
        else:
            self._drop(slot)

    def _drop(self, slot: int) -> None:
        """The slot's adapter is no longer resident; the slot is the first to reuse."""
        del self._slot_of[self.adapter[slot].id]
        self.adapter[slot] = None
        self._unused.move_to_end(slot, last=False)

    def reset(self) -> None:
        """New workers hold no adapter: every slot is empty (no request holds one)."""
        self.__init__(self.num_slots)

    @property
    def resident(self) -> list[str]:
        return [a.name for a in self.adapter if a is not None]


class Adapters:
    """The scheduler actor's adapter operations: the registry requests name adapters from,
    loading and unloading at run time, and what /health shows."""

    def __init__(self, cfg, on_request=lambda name: None):
        self.cfg = cfg
        self.on_request = on_request  # counts a request of an adapter (by name)
        self.registry = LoRARegistry(cfg.max_lora_rank)
        self.slots: LoRASlots | None = None  # the scheduler's, once the engine is up
        self._loading: dict[str, asyncio.Task] = {}  # dynamic loads under way, by name

    def load_configured(self) -> None:
        """Check the lora_modules arg's adapters' configs before the workers start (a
        LoRAError fails the start); they are read and added once the model is known."""
        for name, path in self.cfg.lora_modules.items():
            self.registry.check_name(name, set(self.cfg.model_names))
            read_adapter(name, path, self.cfg.max_lora_rank, 0)

    def of(self, name: str | None) -> AdapterInfo | Refusal | None:
        """The adapter a request names (None: the base model), or why it cannot run."""
        if name is None:
            return None
        info = self.registry.adapters.get(name)
        if info is None:
            return Refusal("unknown_model", f"The model `{name}` does not exist.")
        self.on_request(name)
        return info

    async def know_engine(self, engine) -> None:
        """The engine started: its slots, its model to check adapters against, and the
        configured adapters (LoRAError if one does not fit)."""
        self.slots = engine.scheduler.loras
        self.registry.model = (engine.info.lora_shapes, engine.info.num_layers,
                               engine.info.moe_layers)
        for name, path in self.cfg.lora_modules.items():
            self.registry.insert(await asyncio.to_thread(self.registry.read, name, path))

    async def load(self, name: str, path: str) -> Refusal | None:
        """Add an adapter at run time; its files are read in a thread (steps go on)."""
        if not self.cfg.lora_enabled:
            return Refusal("lora_disabled", "LoRA adapters are not enabled on this server "
                           "(start it with enable_lora: true)")
        reserved = set(self.cfg.model_names)
        try:
            self.registry.check_name(name, reserved)
            self.registry.insert(await asyncio.to_thread(self.registry.read, name, path),
                                 reserved)
        except LoRAError as e:
            return Refusal("invalid_adapter", str(e))
        return None

    async def resolve(self, name: str | None) -> Refusal | None:
        """dynamic_lora_loading_path: load an adapter a request names that is not loaded
        from the directory of its name (`<model>:NAME` reads NAME, as Ray Serve LLM names
        them) when there is one; concurrent requests share one load. None when there is
        nothing to load (an unknown name is refused later, as any)."""
        root = self.cfg.dynamic_lora_loading_path
        if root is None or name is None or name in self.registry.adapters:
            return None
        base = next((m for m in self.cfg.model_names if name.startswith(f"{m}:")), None)
        leaf = name[len(base) + 1:] if base else name
        path = os.path.join(root, leaf)
        if leaf in ("", ".", "..") or os.sep in leaf or "/" in leaf or not os.path.isdir(path):
            return None  # (never a path outside the directory)
        if name not in self._loading:
            self._loading[name] = asyncio.ensure_future(self.load(name, path))
            self._loading[name].add_done_callback(lambda _: self._loading.pop(name, None))
        return await asyncio.shield(self._loading[name])

    async def served(self, name: str) -> Refusal | None:
        """Why requests may not name adapter `name` (it is loaded first, as by resolve), or
        None: for the routes that never reach the engine."""
        refusal = await self.resolve(name)
        if refusal is None and name not in self.registry.adapters:
            return Refusal("unknown_model", f"The model `{name}` does not exist.")
        return refusal

    async def resolve_all(self, names) -> dict[str | None, Refusal | None]:
        """resolve() for each distinct name of `names`."""
        return {name: await self.resolve(name) for name in set(names)}

    def unload(self, name: str) -> Refusal | None:
        """New requests may no longer name it; those already queued finish."""
        try:
            info = self.registry.remove(name)
        except LoRAError as e:
            return Refusal("unknown_model", str(e))
        if self.slots is not None:
            self.slots.forget(info)
        return None

    def paths(self) -> dict[str, str]:
        """name -> directory of every adapter requests may name."""
        return {name: info.path for name, info in self.registry.adapters.items()}

    def stats(self) -> dict:
        """For /health: the adapters requests may name, and those on the device."""
        if not self.cfg.lora_enabled:
            return {}
        return {"lora_adapters": {"loaded": sorted(self.registry.adapters),
                                  "resident": self.slots.resident if self.slots else []}}
