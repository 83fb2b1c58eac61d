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
    """v2 files: what the limit leaves, reclaimable page cache counted as free."""
    (tmp_path / "memory.current").write_text("300\n")
    (tmp_path / "memory.stat").write_text("anon 200\ninactive_file 50\n")
    (tmp_path / "memory.max").write_text("1000\n")
    dirs = [(str(tmp_path), "memory.max", "memory.current", "inactive_file")]
    assert prefetch._cgroup_left(dirs) == 1000 - 300 + 50
    (tmp_path / "memory.max").write_text("max\n")  # no limit
    assert prefetch._cgroup_left(dirs) is None
    assert prefetch._cgroup_left([(str(tmp_path / "none"), *dirs[0][1:])]) is None


def test_a_stopped_prefetch_reads_nothing_more(tmp_path):
    import threading
    save_random_checkpoint(str(tmp_path))
    stop = threading.Event()
    stop.set()
    assert prefetch.prefetch(str(tmp_path), stop).result(timeout=30) == 0
