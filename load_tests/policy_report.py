"""Metrics of a simulated run and the policy-comparison outputs (JSON, markdown, plots).

Definitions (per run of one policy at one rate):
  utility      TCB's total utility: the sum of 1 / (prompt_len + max_tokens) over requests
               that started by their deadline and completed; a request that misses its
               deadline scores 0. Started-but-not-completed requests (killed by the engine
               after a preemption, see killed_after_start) score 0 as well.
  hit_ratio    completed requests / all requests (a request completes iff it started in time).
  throughput   completed requests and generated tokens (of every request) per second, over
               the time from the first arrival to the last completion.
  normalized   ORCA's normalized latency: (finish - arrival) / generated tokens, completed
  latency      requests, median and p99 (linear interpolation between ranks).
"""
from __future__ import annotations

import json
import os
import textwrap

from load_tests.metrics import percentile

METRICS = [  # (key, axis label, log scale)
    ("utility", "total utility (sum of 1/length)", False),
    ("hit_ratio", "deadline hit ratio", False),
    ("request_throughput", "throughput (completed requests/s)", False),
    ("normalized_latency_ms", "normalized latency (ms/token)", True),
]


def utility_of(prompt_len: int, max_tokens: int) -> float:
    return 1.0 / (prompt_len + max_tokens)


def sweep_report(result) -> dict:
    """The metrics of one SimResult (see the module docstring)."""
    outcomes = result.outcomes
    if not outcomes:
        raise ValueError("no requests")
    done = [o for o in outcomes if o.finish_reason == "length"]
    start = min(o.arrival_s for o in outcomes)
    end = max((o.finish_s for o in done), default=start)
    duration = end - start
    normalized = [(o.finish_s - o.arrival_s) / o.num_generated * 1e3 for o in done]
    report = {
        "num_requests": len(outcomes), "completed": len(done),
        "utility": sum(utility_of(o.prompt_len, o.max_tokens) for o in done),
        "max_utility": sum(utility_of(o.prompt_len, o.max_tokens) for o in outcomes),
        "hit_ratio": len(done) / len(outcomes),
        "expired": sum(1 for o in outcomes if o.finish_reason == "deadline"
                       and o.start_s is None),
        "killed_after_start": sum(1 for o in outcomes if o.finish_reason == "deadline"
                                  and o.start_s is not None),
        "rejected": sum(1 for o in outcomes if o.finish_reason == "rejected"),
        "duration_s": duration,
        "request_throughput": len(done) / duration if duration > 0 else 0.0,
        "token_throughput": (sum(o.num_generated for o in outcomes) / duration
                             if duration > 0 else 0.0),
        "normalized_latency_ms": {"median": percentile(normalized, 50),
                                  "p99": percentile(normalized, 99)} if normalized else None,
        "num_preemptions": result.num_preemptions, "num_steps": result.num_steps,
        "busy_fraction": result.busy_s / (result.end_s - start) if result.end_s > start else 0.0,
    }
    return report


def markdown_table(runs: list[dict], rates: list[float] | None = None) -> str:
    lines = [("| rate req/s | policy | utility | hit ratio | req/s | gen tok/s | "
              "norm. latency median / p99 ms | preemptions | killed after start |"),
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        if rates is not None and r["rate"] not in rates:
            continue
        lat = r["normalized_latency_ms"]
        lat_s = f"{lat['median']:.1f} / {lat['p99']:.1f}" if lat else "-"
        lines.append(f"| {r['rate']:g} | {r['policy']} | {r['utility']:.2f} | "
                     f"{r['hit_ratio']:.3f} | {r['request_throughput']:.1f} | "
                     f"{r['token_throughput']:.0f} | {lat_s} | {r['num_preemptions']} | "
                     f"{r['killed_after_start']} |")
    return "\n".join(lines)


def plot(runs: list[dict], key: str, ylabel: str, log: bool, title: str, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4.2))
    # distinct markers, shrinking: curves that coincide (fcfs and priority when KV is not
    # short) stay visible
    for i, policy in enumerate(dict.fromkeys(r["policy"] for r in runs)):
        pts = sorted((r["rate"], r[key]) for r in runs if r["policy"] == policy)
        style = {"marker": "os^Dv"[i % 5], "markersize": 8 - i, "linewidth": 2.2 - 0.3 * i}
        if key == "normalized_latency_ms":
            med = [(x, y["median"]) for x, y in pts if y]
            p99 = [(x, y["p99"]) for x, y in pts if y]
            line, = ax.plot(*zip(*med), label=f"{policy} median", **style)
            ax.plot(*zip(*p99), linestyle="--", color=line.get_color(),
                    label=f"{policy} p99", **style)
        else:
            ax.plot(*zip(*pts), label=policy, **style)
    if log:
        ax.set_yscale("log")
    ax.set_xlabel("offered rate (requests/s)")
    ax.set_ylabel(ylabel)
    ax.set_title(textwrap.fill(title, 80), fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_outputs(report: dict, out_dir: str, label: str) -> list[str]:
    """<label>.json, <label>.md and one <label>-<metric>.png per metric."""
    paths = [os.path.join(out_dir, f"{label}.json"), os.path.join(out_dir, f"{label}.md")]
    with open(paths[0], "w") as f:
        json.dump(report, f, indent=1)
    e = report["engine"]
    header = (f"{label}: {report['trace']['num_requests']} requests, max_batch_size "
              f"{e['max_batch_size']}, max_num_batched_tokens {e['max_num_batched_tokens']}, "
              f"KV {e['max_num_tokens']} tokens; capacity estimate "
              f"{report['capacity_estimate_rps']:.1f} req/s")
    with open(paths[1], "w") as f:
        f.write(f"{header}\n\n{markdown_table(report['runs'])}\n")
    for key, ylabel, log in METRICS:
        path = os.path.join(out_dir, f"{label}-{key.split('_')[0]}.png")
        plot(report["runs"], key, ylabel, log, header, path)
        paths.append(path)
    print("\n".join(paths))
    return paths
