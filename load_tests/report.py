"""Reports over load_client JSON results: a markdown table, ORCA Figure 10's plot, and the
highest rate each system sustains.

    python -m load_tests.report results/orca.json results/hf-cb.json results/hf-static.json \\
        --plot results/latency-throughput.png --markdown results/table.md

The plot is ORCA's Figure 10 form: median normalized latency (end-to-end latency / generated
tokens, ms/token) against achieved throughput (requests/s), one curve per system, one point
per offered rate. Results files with the same `system` label are merged into one curve.

Sustained rate: a system's unloaded normalized latency is its median at its lowest offered
rate; the highest rate it sustains is where its median normalized latency first reaches twice
that, interpolated linearly between the two measured rates around the crossing (ORCA uses
2x the normalized execution time as its latency budget). A rate whose run completed nothing
counts as over budget. If no measured rate reaches 2x, the highest one measured is reported
as a lower bound ("≥").
"""
from __future__ import annotations

import argparse
import json
import math


def save_json(path: str | None, report) -> None:
    """Write a benchmark's report as JSON to `path` (its --out), if one was given."""
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)


def load_reports(paths: list[str]) -> list[dict]:
    """One report per system label, runs merged and sorted by offered rate."""
    systems: dict[str, dict] = {}
    for path in paths:
        with open(path) as f:
            report = json.load(f)
        if "runs" not in report or "system" not in report:
            raise ValueError(f"{path}: not a load_client report (no 'system'/'runs')")
        merged = systems.setdefault(report["system"], {**report, "runs": []})
        merged["runs"] = merged["runs"] + report["runs"]
    for report in systems.values():
        report["runs"].sort(key=lambda r: _rate_key(r["rate"]))
    return list(systems.values())


def _rate_key(rate) -> float:
    if rate == "inf":
        return math.inf
    if rate == "trace":
        return -1.0
    return float(rate)


def _median(run: dict, metric: str) -> float | None:
    dist = run.get(metric)
    return None if not dist or not run.get("completed") else dist["median"]


def sustained_rate(runs: list[dict]) -> dict | None:
    """{baseline_ms, threshold_ms, rate, throughput, is_lower_bound} from runs at finite
    numeric rates (at least two), or None when there are too few."""
    points = sorted((float(r["rate"]), _median(r, "normalized_latency_ms"),
                     r.get("request_throughput", 0.0))
                    for r in runs if not isinstance(r["rate"], str))
    if len(points) < 2 or points[0][1] is None:
        return None
    baseline = points[0][1]
    threshold = 2 * baseline
    for (r0, y0, x0), (r1, y1, x1) in zip(points, points[1:]):
        if y1 is None:  # nothing completed: the system is past its limit at r1
            return {"baseline_ms": baseline, "threshold_ms": threshold, "rate": r0,
                    "throughput": x0, "is_lower_bound": False}
        if y1 >= threshold:
            f = (threshold - y0) / (y1 - y0)
            return {"baseline_ms": baseline, "threshold_ms": threshold,
                    "rate": r0 + f * (r1 - r0), "throughput": x0 + f * (x1 - x0),
                    "is_lower_bound": False}
    rate, _, throughput = points[-1]
    return {"baseline_ms": baseline, "threshold_ms": threshold, "rate": rate,
            "throughput": throughput, "is_lower_bound": True}


def _fmt(dist: dict | None, key: str = "median") -> str:
    return "-" if not dist else f"{dist[key]:.1f}"


def markdown_table(reports: list[dict]) -> str:
    """One row per system and rate."""
    lines = ["| system | rate | done/failed | req/s | out tok/s | TTFT p50/p99 ms | "
             "TPOT p50/p99 ms | ITL p50/p99 ms | E2E p50/p99 ms | norm. lat. p50 ms/tok | "
             "goodput req/s | cached prompt share |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for report in reports:
        for r in report["runs"]:
            pair = [f"{_fmt(r.get(m))}/{_fmt(r.get(m), 'p99')}"
                    for m in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms")]
            goodput = f"{r['goodput']:.2f}" if "goodput" in r else "-"
            lines.append(f"| {report['system']} | {r['rate']} | {r['completed']}/{r['failed']} "
                         f"| {r['request_throughput']:.2f} | {r['output_throughput']:.0f} | "
                         + " | ".join(pair)
                         + f" | {_fmt(r.get('normalized_latency_ms'))} | {goodput} | "
                         f"{_share(r.get('cached_prompt_fraction'))} |")
    return "\n".join(lines)


def _share(value) -> str:
    return "-" if value is None else f"{value:.2f}"  # older results files lack it


def sustained_table(reports: list[dict]) -> str:
    lines = ["| system | unloaded norm. lat. ms/tok | 2x budget ms/tok | highest sustained "
             "rate req/s | throughput there req/s |", "| --- | --- | --- | --- | --- |"]
    for report in reports:
        s = sustained_rate(report["runs"])
        if s is None:
            lines.append(f"| {report['system']} | - | - | needs two or more numeric rates | - |")
            continue
        bound = "≥ " if s["is_lower_bound"] else ""
        lines.append(f"| {report['system']} | {s['baseline_ms']:.1f} | {s['threshold_ms']:.1f} "
                     f"| {bound}{s['rate']:.2f} | {s['throughput']:.2f} |")
    return "\n".join(lines)


def plot(reports: list[dict], path: str, title: str | None = None):
    """Median normalized latency vs throughput, one curve per system; writes a PNG."""
    import matplotlib
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for report in reports:
        pts = [(r["request_throughput"], _median(r, "normalized_latency_ms"))
               for r in report["runs"]]
        pts = [(x, y) for x, y in pts if y is not None]
        if pts:
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=report["system"])
    ax.set_xlabel("throughput (requests/s)")
    ax.set_ylabel("median normalized latency (ms/token)")
    ax.set_title(title or "normalized latency vs throughput")
    ax.grid(True, alpha=0.3)
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return fig


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", help="load_client JSON reports")
    p.add_argument("--plot", help="write the latency-throughput PNG here")
    p.add_argument("--title", help="plot title")
    p.add_argument("--markdown", help="also write the tables to this file")
    args = p.parse_args(argv)
    reports = load_reports(args.results)
    text = markdown_table(reports) + "\n\n" + sustained_table(reports) + "\n"
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    if args.plot:
        plot(reports, args.plot, args.title)
        print(f"plot: {args.plot}")
    return text


if __name__ == "__main__":
    main()
