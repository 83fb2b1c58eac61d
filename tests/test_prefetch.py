"""Reading a checkpoint's weight files ahead of the workers (engine_actors/prefetch.py)."""
import os

from engine_actors import prefetch
from engine_actors.checkpoint import save_random_checkpoint


def test_prefetch_reads_every_weight_file_whole(tmp_path):
    save_random_checkpoint(str(tmp_path), max_shard_size="100KB")
    files = sorted(tmp_path.glob("*.safetensors"))
    assert len(files) > 1  # sharded
    future = prefetch.prefetch(str(tmp_path))
    assert future.result(timeout=30) == sum(os.path.getsize(f) for f in files)


def test_prefetch_skips_what_memory_cannot_hold_and_dirs_without_weights(tmp_path,
                                                                         monkeypatch):
    save_random_checkpoint(str(tmp_path))
    size = sum(os.path.getsize(f) for f in tmp_path.glob("*.safetensors"))
    monkeypatch.setattr(prefetch, "available_memory", lambda: 2 * size - 1)
    assert prefetch.prefetch(str(tmp_path)) is None
    monkeypatch.setattr(prefetch, "available_memory", lambda: 2 * size)
    assert prefetch.prefetch(str(tmp_path)).result(timeout=30) == size
    assert prefetch.prefetch(str(tmp_path / "nothing")) is None


def test_available_memory_is_read_from_the_system():
    assert prefetch.available_memory() > 1 << 20


def test_a_memory_cgroup_limit_caps_the_available_memory(tmp_path):
    limit, usage = tmp_path / "memory.max", tmp_path / "memory.current"
    usage.write_text("300\n")
    limit.write_text("1000\n")
    assert prefetch._cgroup_left([(str(limit), str(usage))]) == 700
    limit.write_text("max\n")  # v2 without a limit
    assert prefetch._cgroup_left([(str(limit), str(usage))]) is None
    assert prefetch._cgroup_left([(str(tmp_path / "none"), str(usage))]) is None
