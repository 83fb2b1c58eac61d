"""Fine-tuning's scheduling without a model: a job's micro-batches and their bookkeeping,
the memory plan against the KV pool, FineInfer's deferral rule and what this project adds
to it (draining, lulls for long steps), and micro-batches sent ahead and called off."""
from __future__ import annotations

import os

import pytest


def test_fineinfer_deferral_rule():
    from engine_actors.finetune_jobs import may_defer
    assert may_defer([], None, 0.2)  # nobody waits: train back to back
    assert not may_defer([0.0], None, 0.2)  # step time not measured yet: serve first
    assert may_defer([0.05, 0.01], 0.1, 0.2)  # 50 ms waited + 100 ms step <= 200 ms
    assert not may_defer([0.15, 0.0], 0.1, 0.2)  # the oldest would wait 250 ms


def test_micro_batches_cover_each_epoch_once_within_the_token_cap():
    from engine_actors.finetune_job import Job
    lens = [5, 3, 7, 2, 6]
    examples = [([1] * n, [False] + [True] * (n - 1)) for n in lens]
    job = Job("j", "m", "f", examples, n_epochs=2, batch_size=2, learning_rate=1e-3,
              lora={}, suffix=None, seed=1)
    assert job.total_steps == 6
    seen, steps = [], 0
    while steps < job.total_steps:
        batch, batch_tokens = [], None
        while True:
            micro, loss_tokens, last = job.next_micro(max_tokens=8)
            assert sum(lens[i] for i in micro) <= 8 or len(micro) == 1
            batch += micro
            batch_tokens = loss_tokens
            if last:
                break
        assert batch_tokens == sum(lens[i] - 1 for i in batch) and len(batch) <= 2
        seen += batch
        steps += 1
    assert sorted(seen[:5]) == sorted(seen[5:]) == list(range(5))


def _planner(free_bytes, guess=8.0, max_tokens=1000):
    """FineTuning with a worker's memory report: `free_bytes` beside a pool of 64 one-token
    blocks, lent in 8 units of 8 blocks that free 500 bytes each."""
    from engine_actors.config import EngineConfig
    from engine_actors.finetune_jobs import FineTuning
    from engine_actors.kv_cache import KVCacheManager
    ft = FineTuning(EngineConfig(finetune_max_tokens=max_tokens), adapters=None)
    ft.memory = {"free_bytes": free_bytes, "lend_unit_blocks": 8, "lendable_units": 8,
                 "lend_unit_bytes": 500, "bytes_per_token_guess": guess}
    return ft, KVCacheManager(num_blocks=64, block_size=1, max_num_seqs=4)


def _job(lengths, batch_size=None):
    from engine_actors.finetune_job import Job
    examples = [([1] * n, [True] * n) for n in lengths]
    return Job("j", "m", "f", examples, n_epochs=1, batch_size=batch_size or len(lengths),
               learning_rate=1e-3, lora={}, suffix=None, seed=0, _plan=[list(range(len(lengths)))])


def test_micro_batch_shrinks_to_the_memory_the_kv_pool_can_lend():
    from engine_actors.request import Request, SamplingParams
    ft, kv = _planner(free_bytes=2000)
    job = _job([100] * 10)
    job.bytes_per_token = 8.0  # 10 bytes a token with the margin
    # wants 10,000 bytes for 1,000 tokens: the whole pool gives 4,000 more, 600 tokens
    assert ft.plan(job, kv) == (8, [0, 1, 2, 3, 4, 5])
    assert kv.num_lent_blocks == 64
    kv.take_back()
    held = Request("held", list(range(40)), SamplingParams(max_tokens=1), 0.0)
    kv.admit(held, held.max_num_tokens)  # 41 blocks promised
    kv.grow(held, 40)
    assert ft.plan(job, kv) == (2, [0, 1, 2])  # 23 blocks unpromised: two units
    kv.take_back()
    kv.free(held)
    ft.memory["free_bytes"] = 20000  # enough beside the pool: nothing lent
    assert ft.plan(job, kv) == (0, list(range(10))) and kv.num_lent_blocks == 0
    ft.memory["free_bytes"] = None  # CPU: not bounded
    assert ft.plan(job, kv) == (0, list(range(10))) and kv.num_lent_blocks == 0


def test_until_measured_a_micro_batch_is_one_example_and_lends_only_what_it_needs():
    ft, kv = _planner(free_bytes=1000, guess=40.0)  # 50 bytes a token with the margin
    job = _job([30, 30, 30])
    assert ft.plan(job, kv) == (1, [0])  # 1,500 bytes: 500 short, one unit, not the cap's
    assert kv.num_lent_blocks == 8
    job.take_micro([0])
    job.bytes_per_token = 40.0  # measured: now as many examples as fit
    # 3,000 bytes: 1,000 free and the unit lent already leave 1,500: 3 units more
    assert ft.plan(job, kv) == (4, [1, 2])
    assert kv.num_lent_blocks == 32


def test_an_example_that_cannot_fit_now_waits_without_evicting_cached_blocks():
    from engine_actors.request import Request, SamplingParams
    ft, kv = _planner(free_bytes=0, guess=8.0)  # 10 bytes a token; the pool can give 4,000
    job = _job([300])
    running = Request("r", list(range(64)), SamplingParams(max_tokens=1), 0.0)
    kv.admit(running, 64)
    kv.grow(running, 64)  # every block held: none can be lent now
    evictable = kv.pool.num_available
    assert ft.plan(job, kv) is None
    assert kv.num_lent_blocks == 0 and kv.pool.num_available == evictable


def test_an_example_that_could_never_fit_fails_its_job_with_the_sizes():
    ft, kv = _planner(free_bytes=1000, guess=8.0)  # 10 bytes a token; at most 5,000 bytes
    with pytest.raises(ValueError, match="example of 600 tokens needs .* at most"):
        ft.plan(_job([600]), kv)
    assert kv.num_lent_blocks == 0


def test_lent_blocks_are_not_counted_as_kv_usage():
    ft, kv = _planner(free_bytes=0)
    assert kv.lend(2, 8, 8) == 2
    assert kv.usage == 0.0 and kv.num_lent_blocks == 16


def test_a_micro_batch_takes_the_examples_that_fit_in_order():
    from engine_actors.finetune_job import Job
    examples = [([1] * n, [True] * n) for n in (300, 200, 500)]
    job = Job("j", "m", "f", examples, n_epochs=1, batch_size=3, learning_rate=1e-3,
              lora={}, suffix=None, seed=0)
    job._plan = [[0, 1, 2]]
    assert job.next_micro(250) is None  # the next example alone is over the cap
    assert job.next_micro(600) == ([0, 1], 1000, False)
    assert job.next_micro(400) is None
    assert job.next_micro(500) == ([2], 1000, True)


class _Executor:
    """The workers' side of take_back: fails `failures` times, then maps."""

    def __init__(self, failures):
        import ray
        self.failures, self.calls, self.error = failures, [], ray.exceptions.RayError

    async def finetune(self, method, job_id, *args):
        self.calls.append(method)
        if method == "take_back" and self.failures:
            self.failures -= 1
            raise self.error("cuMemCreate failed with error 2")


@pytest.mark.parametrize("failures,ok", [(0, True), (1, True), (2, False)])
def test_lent_blocks_that_cannot_be_mapped_again_fail_the_job_not_serving(failures, ok):
    import asyncio
    ft, kv = _planner(free_bytes=0)
    job = _job([10])
    job.started, job.status = True, "running"
    ft.jobs[job.id], ft.queue = job, [job]
    kv.lend(2, 8, 8)
    executor = _Executor(failures)
    assert asyncio.run(ft.take_back(executor, kv)) is ok
    assert kv.num_lent_blocks == (0 if ok else 16)  # the pool has them back once mapped
    if failures:  # the running job's trainer held the memory: the job fails, it is freed
        assert job.status == "failed" and "could not be returned" in job.error["message"]
        assert executor.calls[:3] == ["take_back", "drop", "take_back"]
    else:
        assert job.status == "running" and executor.calls == ["take_back"]


def test_a_job_waiting_for_memory_wakes_the_loop_when_it_may_try_again():
    ft, kv = _planner(free_bytes=0)
    assert ft.wake_in(100.0) is None
    ft.queue = [_job([10])]
    ft.retry_at = 100.1
    assert ft.wake_in(100.0) == pytest.approx(0.1)
    assert ft.wake_in(100.2) is None


def test_new_requests_are_held_only_while_a_step_fits_in_their_deferral_bound():
    from engine_actors.config import EngineConfig
    from engine_actors.finetune_jobs import FineTuning
    ft = FineTuning(EngineConfig(finetune_deferral_ms=200), adapters=None)
    assert ft.hold_from(10.0, 0.0) is None  # no job
    ft.queue = [_job([10])]
    assert ft.hold_from(10.0, 0.0) is None  # its step time not measured yet
    ft.step_s = 0.05
    assert ft.hold_from(10.0, 0.0) == pytest.approx(9.85)  # held while wait + 50 ms <= 200
    # the running batch needs 100 ms to drain: a request may wait 50 ms more at most
    assert ft.hold_from(10.0, 0.1) == pytest.approx(9.95)
    assert ft.hold_from(10.0, 0.2) is None  # it could not drain in time: nothing held
    ft.retry_at = 10.5  # waiting for memory: no step could run
    assert ft.hold_from(10.0, 0.0) is None
    ft.retry_at, ft.step_s = 0.0, 0.3  # a step longer than the bound: never deferred
    assert ft.hold_from(10.0, 0.0) is None


def test_mapping_memory_back_counts_in_the_time_a_step_defers_requests():
    from engine_actors.config import EngineConfig
    from engine_actors.finetune_jobs import FineTuning
    ft = FineTuning(EngineConfig(finetune_deferral_ms=200), adapters=None)
    ft.queue = [_job([10])]
    ft.step_s = 0.05
    assert ft.hold_from(10.0, 0.0) == pytest.approx(9.85)
    ft.take_back_s = 0.1  # measured: inference resumes 150 ms after a step starts
    assert ft.hold_from(10.0, 0.0) == pytest.approx(9.95)
    assert ft.hold_from(10.0, 0.1) is None


def test_a_batch_loss_is_right_when_the_next_batch_was_taken_before_it_was_recorded():
    from engine_actors.finetune_job import Job
    examples = [([1] * 4, [True] * k) for k in (1, 3, 2, 6)]  # trained tokens 1, 3, 2, 6
    job = Job("j", "m", "f", examples, n_epochs=1, batch_size=2, learning_rate=1e-3,
              lora={}, suffix=None, seed=0)
    job._plan = [[0, 1], [2, 3]]
    first = job.next_micro(8)  # the whole first batch (4 trained tokens)
    second = job.next_micro(4)  # sent ahead: the second batch's first example (of 8)
    assert first[1:] == (4, True) and second[1:] == (8, False)
    assert job.record(8, 2.0, *first[1:]) == pytest.approx(0.5)  # 2.0 over 4 tokens
    assert job.record(4, 1.0, *second[1:]) is None
    third = job.next_micro(4)
    assert job.record(4, 3.0, *third[1:]) == pytest.approx(0.5)  # (1.0 + 3.0) over 8
    assert job.steps_done == 2 and job.trained_tokens == 16 and not job.has_next()


def test_memory_per_token_comes_from_the_largest_micro_batch_measured():
    job = _job([10])
    job.measure_memory(3000, 10)  # one short example: its fixed costs weigh 300 a token
    assert job.bytes_per_token == 300
    job.measure_memory(100_000, 1000)  # a full micro-batch: 100 a token
    assert job.bytes_per_token == 100
    job.measure_memory(2000, 10)  # smaller than the one measured: not used
    job.measure_memory(120_000, 1000)  # as large and worse: used
    assert job.bytes_per_token == 120


def test_a_step_longer_than_the_bound_never_runs_whole():
    """A whole micro-batch longer than the bound would hold whoever arrives during it past
    the bound: the job's micro-batches run in pieces instead, however long none arrived."""
    from engine_actors.config import EngineConfig
    from engine_actors.finetune_jobs import FineTuning

    class Idle:  # the scheduler: nothing running or waiting
        num_running, waiting = 0, []

    ft = FineTuning(EngineConfig(finetune_deferral_ms=200), adapters=None)
    ft.queue = [_job([10])]
    assert ft.wants_step(Idle, 10.0) and not ft.in_pieces  # unknown: FineInfer's rule
    ft.step_s = 0.15  # within the bound: whoever comes waits at most the bound
    assert ft.wants_step(Idle, 10.0) and not ft.in_pieces
    ft.step_s = 0.3
    assert not ft.wants_step(Idle, 10.0) and ft.in_pieces
    ft.step_s, ft.take_back_s = 0.15, 0.1  # mapping lent memory back counts too
    assert not ft.wants_step(Idle, 10.0) and ft.in_pieces
    ft.take_back_s = None
    ft.measure_pieces(0.5, 1000)  # a micro-batch in pieces took longer: its estimate grows
    assert ft.step_s == pytest.approx(0.8 * 0.15 + 0.2 * 0.5) and ft.in_pieces
    assert ft.micro_tokens == pytest.approx(200)  # from 0, as after whole ones


def test_a_micro_batch_called_off_before_it_started_runs_next():
    import asyncio
    from engine_actors.config import EngineConfig
    from engine_actors.finetune_jobs import FineTuning

    class Executor:  # the workers: micro-batch 2 is called off before it starts
        def __init__(self):
            self.skipped, self.device = set(), asyncio.Lock()  # calls run in order

        def skip_training(self, seq):
            self.skipped.add(seq)

        async def finetune(self, method, job_id, seq, after, units, seqs, *rest):
            async with self.device:
                if seq in self.skipped:
                    return {"skipped": True, "free_bytes": None}
                await asyncio.sleep(0.05)
            return {"loss_sum": 1.0, "tokens": sum(map(len, seqs)), "peak_bytes": None,
                    "elapsed_s": 0.01, "free_bytes": None}

    ft = FineTuning(EngineConfig(finetune_max_tokens=10), adapters=None)
    ft.memory = {"free_bytes": None}  # CPU: micro-batches bounded by the token cap alone
    job = _job([10, 10, 10, 10])  # one example a micro-batch
    job.started, job.status = True, "running"
    ft.jobs[job.id], ft.queue = job, [job]
    executor = Executor()

    async def run():
        first = asyncio.create_task(ft.step(executor, None, pipeline=lambda: True))
        await asyncio.sleep(0.02)  # example 0 runs, 1 was sent ahead
        assert ft.ahead.micro == [1]
        ft.skip_ahead(executor)  # a request came
        await first
        assert job.trained_tokens == 10
        await ft.step(executor, None)  # the answer: skipped
        assert ft.ahead is None and job.trained_tokens == 10 and job._rest == [1, 2, 3]
        await ft.step(executor, None)  # example 1 now
        assert job.trained_tokens == 20 and job._rest == [2, 3]

    asyncio.run(run())


def test_stored_files_are_capped_and_deleting_frees_room(monkeypatch):
    from engine_actors import finetune_jobs
    from engine_actors.config import EngineConfig
    from engine_actors.messages import Refusal
    monkeypatch.setattr(finetune_jobs, "MAX_STORED_BYTES", 10)
    ft = finetune_jobs.FineTuning(EngineConfig(), adapters=None)
    first = ft.add_file("a.jsonl", "fine-tune", b"123456")
    assert ft.file(first["id"], True) == b"123456"
    refused = ft.add_file("b.jsonl", "fine-tune", b"12345")  # 6 + 5 > 10
    assert isinstance(refused, Refusal) and "DELETE" in refused.message
    assert ft.delete_file(first["id"]) == {"id": first["id"], "object": "file",
                                           "deleted": True}
    assert ft.file(first["id"]) is None and ft.delete_file(first["id"]) is None
    assert ft.add_file("b.jsonl", "fine-tune", b"12345")["bytes"] == 5


def test_jobs_beyond_the_queue_are_refused_until_one_ends(monkeypatch):
    from engine_actors import finetune_jobs
    from engine_actors.config import EngineConfig
    from engine_actors.messages import Refusal
    monkeypatch.setattr(finetune_jobs, "MAX_QUEUED_JOBS", 2)
    ft = finetune_jobs.FineTuning(EngineConfig(), adapters=None)
    spec = dict(model="m", training_file="file-x", examples=[([1, 2], [False, True])],
                suffix=None, seed=0, n_epochs=1, batch_size=1, learning_rate=1e-3,
                lora={"r": 8, "alpha": 16, "target_modules": ["q_proj"]})
    first, second = ft.create(dict(spec)), ft.create(dict(spec))
    third = ft.create(dict(spec))
    assert isinstance(third, Refusal) and third.code == "queue_full"
    ft._end(ft.jobs[first["id"]], "cancelled")
    assert ft.create(dict(spec))["status"] == "queued" and second["status"] == "queued"


def test_an_ended_job_frees_its_examples_and_keeps_its_record():
    from engine_actors.config import EngineConfig
    from engine_actors.finetune_jobs import FineTuning
    ft = FineTuning(EngineConfig(), adapters=None)
    examples = [([1, 2, 3], [False, True, True])] * 5
    job = ft.jobs[ft.create(dict(model="m", training_file="file-x", examples=examples,
                                 suffix=None, seed=0, n_epochs=2, batch_size=2,
                                 learning_rate=1e-3,
                                 lora={"r": 8, "alpha": 16, "target_modules": ["q_proj"]}))["id"]]
    job.next_micro(100)  # planned and partly taken
    ft._end(job, "cancelled")
    assert job.examples == [] and not job.has_next()
    record = ft.job(job.id)
    assert record["status"] == "cancelled" and record["total_steps"] == 6  # 2 x ceil(5 / 2)


def test_jobs_listed_by_metadata_page_after_any_job_even_one_the_filter_leaves_out():
    import dataclasses

    from engine_actors.config import EngineConfig
    from engine_actors.finetune_jobs import FineTuning
    ft = FineTuning(EngineConfig(), adapters=None)
    for i, team in enumerate(["a", "b", "a", "b"]):  # created oldest first
        ft.jobs[f"j{i}"] = dataclasses.replace(_job([4]), id=f"j{i}", metadata={"team": team})
    ids = lambda listed: [j["id"] for j in listed["data"]]  # noqa: E731
    assert ids(ft.list_jobs(metadata={"team": "a"})) == ["j2", "j0"]  # newest first
    assert ids(ft.list_jobs(after="j3", metadata={"team": "a"})) == ["j2", "j0"]
    assert ids(ft.list_jobs(after="j2", limit=1, metadata={"team": "b"})) == ["j1"]
    assert ft.list_jobs(after="nope").code == "unknown_after"


def test_the_default_adapter_directory_goes_with_the_engine(tmp_path):
    """A temp directory per engine used to stay behind after shutdown (thousands piled up);
    a finetune_dir that the user set is kept."""
    from engine_actors.config import EngineConfig
    from engine_actors.finetune_jobs import FineTuning
    ft = FineTuning(EngineConfig(), adapters=None)
    assert os.path.isdir(ft.dir)
    ft.close()
    assert not os.path.exists(ft.dir)
    kept = FineTuning(EngineConfig(finetune_dir=str(tmp_path)), adapters=None)
    kept.close()
    assert kept.dir == str(tmp_path) and os.path.isdir(tmp_path)


def test_directories_of_killed_engines_are_removed_at_start(tmp_path, monkeypatch):
    """A scheduler killed before its teardown leaves its directory: the next engine on the
    machine removes those marked by a process of this host that is gone, and nothing else
    (live engines', unmarked or other hosts' directories, a user's finetune_dir)."""
    import socket
    import subprocess
    import sys
    import tempfile

    from engine_actors.config import EngineConfig
    from engine_actors.finetune_jobs import FineTuning
    from engine_actors.lora_files import OWNER_FILE
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    host = socket.gethostname()
    marks = {"dead": f"{host} {gone.pid}", "live": f"{host} {os.getppid()}",
             "elsewhere": f"another-host {gone.pid}", "unmarked": None}
    for name, mark in marks.items():
        (tmp_path / f"orca-finetune-{name}" / "adapter").mkdir(parents=True)
        if mark is not None:
            (tmp_path / f"orca-finetune-{name}" / OWNER_FILE).write_text(mark)
    user_dir = tmp_path / "orca-finetune-2024-06"  # a finetune_dir, say
    user_dir.mkdir()
    ft = FineTuning(EngineConfig(), adapters=None)
    left = {p.name for p in tmp_path.iterdir()}
    assert left == {"orca-finetune-live", "orca-finetune-elsewhere", "orca-finetune-unmarked",
                    "orca-finetune-2024-06", os.path.basename(ft.dir)}
    assert (tmp_path / os.path.basename(ft.dir) / OWNER_FILE).read_text() == \
        f"{host} {os.getpid()}"
    ft.close()
