"""What `background: true` costs a streamed Responses request, through HTTP: the same request
streamed plainly and as a background response (whose events go through the scheduler's
response store, gathered 20 ms at a time: deployments/background_responses.py), one at a
time, alternating, on one server started as `make serve` starts it.

    python -m load_tests.bench_background_stream --model tiny-random-llama --rounds 15

Prints each mode's median time to the first text delta and to the stream's end.
"""
from __future__ import annotations

import argparse
import statistics
import time

import httpx

from load_tests.bench_http import launched
from load_tests.report import save_json
from tests.serve_fixture import free_port, wait_healthy


def stream_once(url: str, tokens: int, background: bool) -> tuple[float, float]:
    """Seconds to the first output_text delta and to the end of the stream."""
    body = {"model": "bench", "input": "Count on.", "max_output_tokens": tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "background": background}
    start, first = time.perf_counter(), None
    with httpx.stream("POST", f"{url}/v1/responses", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if first is None and '"response.output_text.delta"' in line:
                first = time.perf_counter() - start
    assert first is not None, "no text came"
    return first, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-random-llama")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out")
    args = ap.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with launched({"model": args.model}, port=port):
        wait_healthy(url, timeout=600)
        for _ in range(3):  # warm-up
            for background in (False, True):
                stream_once(url, args.tokens, background)
        runs = {False: [], True: []}
        for _ in range(args.rounds):
            for background in (False, True):
                runs[background].append(stream_once(url, args.tokens, background))
    rows = [{"background": bg, "first_delta_ms": 1000 * statistics.median(r[0] for r in rs),
             "stream_ms": 1000 * statistics.median(r[1] for r in rs)}
            for bg, rs in runs.items()]
    print(f"{args.model}, {args.tokens} tokens, {args.rounds} rounds, medians")
    print("| background | first delta ms | whole stream ms |\n| --- | --- | --- |")
    for r in rows:
        print(f"| {r['background']} | {r['first_delta_ms']:.1f} | {r['stream_ms']:.1f} |")
    save_json(args.out, {"args": vars(args), "results": rows})


if __name__ == "__main__":
    main()
