"""Where a process spent its time, from py-spy's collapsed stacks (`py-spy record -f raw`).

    python -m load_tests.profile_summary prof/http/replica.txt [--top 25]

Prints the functions with the most samples on top of the stack (self) and anywhere in it
(inclusive), as a share of all samples. py-spy samples only threads that are running, so
the total says how busy the process was: samples / (rate x seconds) cores.
"""
from __future__ import annotations

import argparse
import collections


def _name(frame: str) -> str:
    """`func (path/to/file.py:123)` -> `func (file.py)`: lines of one function merge."""
    func, _, where = frame.partition(" (")
    return f"{func} ({where.rsplit('/', 1)[-1].split(':')[0]})" if where else func


def summarize(path: str) -> tuple[int, collections.Counter, collections.Counter]:
    own, inclusive, total = collections.Counter(), collections.Counter(), 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.strip().rpartition(" ")
            if not stack:
                continue
            n = int(count)
            total += n
            frames = [_name(fr) for fr in stack.split(";")]
            own[frames[-1]] += n
            for name in set(frames):
                inclusive[name] += n
    return total, own, inclusive


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("files", nargs="+")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    for path in args.files:
        total, own, inclusive = summarize(path)
        print(f"== {path}: {total} samples")
        for title, counter in (("self", own), ("inclusive", inclusive)):
            print(f"-- {title}")
            for name, n in counter.most_common(args.top):
                print(f"{100 * n / max(total, 1):5.1f}%  {name}")


if __name__ == "__main__":
    main()
