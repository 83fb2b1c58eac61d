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
          "--max-batch-size", "4", "--systems", "orca,hf-static", "--out", str(out)])
    report = json.loads(out.read_text())
    assert not report["failed"]
    assert {r["system"] for r in report["results"]} == {"orca", "hf-static"}
    for r in report["results"]:
        assert r["all_tokens_generated"], r["system"]
    # the reference row is hf-static itself: only the others say anything
    others = [r for r in report["results"] if r["system"] != "hf-static"]
    assert others and all(r["same_tokens_as_hf_static"] == 1.0 for r in others)
