"""bench_finetune's report: its table and its plot over time; and, the command below,
training under load against its latency cost across runs. Each run's trained fraction of
dedicated (x) and its median normalized latency against serving alone in the same run (y)
are plotted beside what taking a share f of the GPU's time costs when the load's own work
keeps a share rho of it, (1 - rho) / (1 - rho - f) (BENCHMARKS.md, 2026-11-26, third
part), and issue 17's target (half of dedicated within 10%).

    python -m load_tests.finetune_report load_tests/results/finetune-llama-8b-h200-{busy05,ci05}.json \\
        --out load_tests/results/finetune-frontier-h200.png
"""
from __future__ import annotations

import argparse
import json
import math
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


def table(r: dict) -> str:
    a, b = r["serve"], r["serve+ft"]
    rows = [("TTFT p99, ms", a["ttft_ms"]["p99"], b["ttft_ms"]["p99"]),
            ("normalized latency p50, ms/token", a["normalized_latency_ms"]["median"],
             b["normalized_latency_ms"]["median"])]
    lines = ["| metric | serving alone | serving + fine-tuning | ratio (95% interval) |",
             "| --- | --- | --- | --- |"]
    for (name, x, y), key in zip(rows, ("ttft_p99", "normalized_latency_p50")):
        low, high = r["intervals"][key][1:] if "intervals" in r else (math.nan, math.nan)
        lines.append(f"| {name} | {x:.2f} | {y:.2f} | {y / x:.2f} ({low:.2f}-{high:.2f}) |")
    d = r["dedicated_tokens_s"]
    lines += ["", "| fine-tuning | trained tokens/s | / dedicated |", "| --- | --- | --- |",
              f"| dedicated (Trainer alone) | {d:.0f} | 1.00 |",
              f"| on the server, under load | {r['loaded_tokens_s']:.0f} | "
              f"{r['loaded_tokens_s'] / d:.2f} |",
              f"| on the server, no load | {r['idle_tokens_s']:.0f} | {r['idle_tokens_s'] / d:.2f} |"]
    if "dedicated_after_tokens_s" in r:
        after = r["dedicated_after_tokens_s"]
        lines.append(f"| dedicated again, after the server | {after:.0f} | {after / d:.2f} |")
    lines += ["", f"Pieces took {r.get('piece_time_share', 0):.3f} of the loaded phase beside "
              f"requests and {r.get('gap_piece_time_share', 0):.3f} between them."]
    waits = (r.get("finetuning_health") or {}).get("stop_wait_ms") or {}
    if waits.get("count"):
        lines.append(f"Runs of pieces stopped for a request: {waits['count']}, in "
                     f"{waits['p50']} / {waits['p99']} / {waits['max']} ms (p50 / p99 / max).")
    return "\n".join(lines)


def plot(r: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = r["timeline"]
    t = [row[0] for row in rows]
    fig, axes = plt.subplots(5, 1, sharex=True, figsize=(8, 11))
    pairs = list(zip(rows, rows[1:]))
    axes[0].plot(t, [0.0] + [(b[1] - a[1]) / (b[0] - a[0]) for a, b in pairs])
    axes[0].set_ylabel("fine-tuning steps/s")
    axes[1].plot(t, [0.0] + [(b[2] - a[2]) / (b[0] - a[0]) for a, b in pairs])
    axes[1].set_ylabel("trained tokens/s")
    axes[2].plot(t, [row[5] for row in rows])
    axes[2].set_ylabel("KV blocks lent")
    axes[3].plot(t, [row[3] for row in rows], label="running")
    axes[3].plot(t, [row[4] for row in rows], label="waiting")
    axes[3].set_ylabel("requests")
    axes[3].legend()
    ttft = [(b[6] - a[6]) / (b[7] - a[7]) * 1e3 if b[7] > a[7] else float("nan")
            for a, b in pairs]
    axes[4].plot(t, [float("nan")] + ttft)
    axes[4].set_ylabel("mean TTFT, ms")
    axes[4].set_xlabel("time, s")
    for name, (start, end) in r["phases_s"].items():  # where the load ran, and the idle part
        for ax in axes:
            ax.axvspan(start, end, alpha=0.08, color="C1" if name != "idle" else "C2")
        axes[0].text(start, 0, name, fontsize=8)
    fig.suptitle(f"fine-tuning beside serving; offered load {r['args']['rate']} req/s in "
                 "the shaded phases")
    fig.savefig(path, dpi=100)


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
