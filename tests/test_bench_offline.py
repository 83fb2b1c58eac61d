"""The offline benchmark's apparatus on CPU: every system gets the same weights and trace,
and in fp32 their greedy tokens agree (so on the GPU only speed differs). transformers'
continuous batching, whose defaults need ~15 GB on CPU, is checked in test_hf_baselines."""
from __future__ import annotations

import json

from load_tests.bench_offline import main


def test_all_systems_agree_in_fp32_on_cpu(tmp_path):
    out = tmp_path / "bench.json"
    main(["--device", "cpu", "--model", "tiny-random-llama", "--num-requests", "10",
          "--prompt-len", "3", "30", "--output-len", "1", "12", "--warmup", "2",
          "--max-batch-size", "4", "--systems", "orca,hf-static", "--adapters", "0", "2",
          "--out", str(out)])
    report = json.loads(out.read_text())
    assert not report["failed"]
    rows = {r["system"]: r for r in report["results"]}
    assert set(rows) == {"orca", "orca-lora2", "hf-static"}
    for r in report["results"]:
        assert r["all_tokens_generated"], r["system"]
    # the reference row is hf-static itself; the base-model engine agrees with it, and the
    # run over two random adapters really applied them
    assert rows["orca"]["same_tokens_as_hf_static"] == 1.0
    assert rows["orca-lora2"]["same_tokens_as_hf_static"] < 1.0
