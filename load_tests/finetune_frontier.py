"""Training under load against its latency cost, from bench_finetune's results: each run's
trained fraction of dedicated (x) and its median normalized latency against serving alone
in the same run (y), beside what taking a share f of the GPU's time costs when the load's
own work keeps a share rho of it, (1 - rho) / (1 - rho - f) (BENCHMARKS.md, 2026-11-26,
third part), and issue 17's target (half of dedicated within 10%).

    python -m load_tests.finetune_frontier load_tests/results/finetune-llama-8b-h200-{busy05,ci05}.json \\
        --out load_tests/results/finetune-frontier-h200.png
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np


def point(path: str) -> tuple[float, float, float]:
    """(share set, trained fraction of dedicated under load, normalized latency ratio)."""
    with open(path) as f:
        r = json.load(f)
    ratio = r["serve+ft"]["normalized_latency_ms"]["median"] \
        / r["serve"]["normalized_latency_ms"]["median"]
    return (r["args"].get("busy_share") or 0.0, r["loaded_tokens_s"] / r["dedicated_tokens_s"],
            ratio)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", help="bench_finetune JSON files, one rate")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for path in args.results:
        share, x, y = point(path)
        ax.scatter(x, y, color="C0")
        ax.annotate(f"f={share:g}", (x, y), textcoords="offset points", xytext=(4, 3),
                    fontsize=7)
        print(f"{os.path.basename(path)}: f={share:g}, {x:.3f} of dedicated, latency {y:.3f}x")
    f = np.linspace(0, 0.55, 200)
    for rho, style in ((0.3, "--"), (0.4, ":")):
        ax.plot(f, (1 - rho) / np.maximum(1 - rho - f, 1e-9), style, color="C1",
                label=f"taking turns, load's own share rho={rho}")
    ax.plot(f, 1 / (1 - f), "-", color="C2", alpha=0.6, label="1 / (1 - f), no load effect")
    ax.scatter([0.5], [1.1], marker="*", s=150, color="C3", label="issue 17's target")
    ax.set_ylim(0.9, 2.5)
    ax.set_xlabel("trained tokens/s under load / dedicated (the curves: share f)")
    ax.set_ylabel("normalized latency p50 / serving alone")
    ax.legend(fontsize=8)
    ax.set_title("Training beside ORCA's trace, llama-8b, one H200")
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)


if __name__ == "__main__":
    main()
