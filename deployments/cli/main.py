"""`orca-serve`: the command-line client of a running orca-serve server (HTTP only).

    orca-serve chat                                interactive chat, streamed, high priority
    orca-serve batch prompts.jsonl                 submit a batch; prints its id and returns
    orca-serve batch --wait prompts.jsonl          ... and follow it: progress bar, then the
                                                   results of each batch as it finishes
    orca-serve batch '["Hi", "Tell me"] [32, 64]'  FineInfer's inline form (one argument)
    orca-serve results ID... | status ID... | cancel ID...
    orca-serve finetune train.jsonl --wait         fine-tune a LoRA adapter in the server's
                                                   idle time: progress bar of steps and loss,
                                                   then the served model name
    orca-serve finetune-status JOB | finetune-cancel JOB

The server is `--url`, or $ORCA_SERVE_URL, or http://127.0.0.1:8000; a server started with
an API key needs `--api-key KEY` or $ORCA_SERVE_API_KEY. Both options may come before or
after the command. Exit status: 0 on success, 1 when the server is unreachable or refuses a
request or a request failed, 2 for bad input, 130 after Ctrl-C.
"""
from __future__ import annotations

import argparse
import os
import sys

import httpx

from deployments.cli.batch import (ResultSink, Submitted, follow, get_status, status_line,
                                   submit)
from deployments.cli.batch_input import REQUEST_FIELDS, USAGE_ERROR, read_sources
from deployments.cli.chat import ChatOptions, run_chat
from deployments.cli.finetune import job_status, run_finetune
from deployments.cli.http import DEFAULT_URL, CLIError, Server

JSONL_HELP = f"""\
Each SOURCE is a JSON Lines file (one request per line: {{"prompt": "...", "max_tokens": 32}},
the prompt being text or a list of token ids, plus any of the server's optional fields:
{', '.join(f for f in REQUEST_FIELDS if f not in ('prompt', 'max_tokens'))}; a bare JSON
string is a prompt), "-" for stdin, or an inline list in FineInfer's form, quoted as one
argument: '["prompt 1", "prompt 2"] [32, 64]' (the max_tokens list is optional). Each source
is one batch (split further with --batch-size). Without --wait the batch ids are printed, one
per line, and the command returns at once: follow them later with `orca-serve results ID...`."""


def server_options(in_command: bool) -> argparse.ArgumentParser:
    """--url and --api-key, as a parent parser of the main parser and of every command, so
    they are accepted before and after the command. In the commands' copies the defaults are
    SUPPRESS: a command sets them only when given, so it never overwrites a value given
    before the command with its default (a value given after the command wins)."""
    p = argparse.ArgumentParser(add_help=False)
    if in_command:
        url_default = key_default = argparse.SUPPRESS
        url_help = key_help = "as before the command (see orca-serve --help)"
    else:
        url_default = os.environ.get("ORCA_SERVE_URL", DEFAULT_URL)
        key_default = os.environ.get("ORCA_SERVE_API_KEY") or None
        url_help = (f"server address: $ORCA_SERVE_URL if set, else {DEFAULT_URL} "
                    "(now: %(default)s)")
        key_help = ("the server's API key, sent as `Authorization: Bearer KEY`: "
                    "$ORCA_SERVE_API_KEY if set")  # the key itself is never printed
    p.add_argument("--url", default=url_default, help=url_help)
    p.add_argument("--api-key", metavar="KEY", default=key_default, help=key_help)
    return p


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="orca-serve", description=__doc__,
                                parents=[server_options(in_command=False)],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # one parent for all the commands: argparse copies its actions into each of them
    common = server_options(in_command=True)

    chat = sub.add_parser("chat", parents=[common],
                          help="interactive chat, streamed, at high priority")
    chat.add_argument("--model", help="model name to send (default: whatever is served)")
    chat.add_argument("--system", help="a system message that starts the conversation")
    chat.add_argument("--max-tokens", type=_positive, default=256,
                      help="longest answer in tokens (default %(default)s)")
    chat.add_argument("--temperature", type=float, help="sampling temperature (server default)")
    chat.add_argument("--priority", type=int, default=0,
                      help="scheduling priority sent with each message, lower first "
                           "(default %(default)s, interactive; batches default to 1)")

    batch = sub.add_parser("batch", parents=[common],
                           help="submit prompts as batches without waiting",
                           description=JSONL_HELP,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    batch.add_argument("sources", nargs="+", metavar="SOURCE")
    batch.add_argument("--max-tokens", type=_positive, default=128,
                       help="for requests that do not set it (default %(default)s)")
    batch.add_argument("--batch-size", type=_positive,
                       help="split each source into batches of at most this many requests")
    batch.add_argument("--priority", type=int,
                       help="batch priority, lower first (default: the server's, 1)")
    batch.add_argument("--model", help="model name to send")
    batch.add_argument("--wait", action="store_true",
                       help="follow the batches: progress bar, results as each batch finishes")
    _add_output_flags(batch, "; implies --wait")

    results = sub.add_parser("results", parents=[common],
                             help="follow batches and print their results")
    results.add_argument("ids", nargs="+", metavar="ID")
    _add_output_flags(results, "")
    finetune = sub.add_parser("finetune", parents=[common],
                              help="fine-tune a LoRA adapter on a JSON Lines training file")
    finetune.add_argument("file", metavar="FILE",
                          help='lines of {"prompt", "completion"} or {"messages": [...]}')
    finetune.add_argument("--model", help="the base model (default: the served one)")
    finetune.add_argument("--suffix", help="part of the fine-tuned model's name")
    finetune.add_argument("--epochs", type=_positive, help="n_epochs (server default)")
    finetune.add_argument("--batch-size", type=_positive, help="batch_size (server default)")
    finetune.add_argument("--learning-rate", type=float, help="learning_rate")
    finetune.add_argument("--rank", type=_positive, help="LoRA rank r (server default)")
    finetune.add_argument("--wait", action="store_true",
                          help="follow the job: progress bar of steps and loss")
    finetune.add_argument("--no-progress", action="store_true", help="no progress bar")
    for name, text in [("finetune-status", "show a fine-tuning job"),
                       ("finetune-cancel", "cancel a fine-tuning job")]:
        sub.add_parser(name, parents=[common], help=text).add_argument("job", metavar="JOB")
    for name, text in [("status", "show batches' progress"),
                       ("cancel", "cancel batches' unfinished requests")]:
        sub.add_parser(name, parents=[common], help=text).add_argument("ids", nargs="+",
                                                                       metavar="ID")
    return p


def _add_output_flags(parser: argparse.ArgumentParser, note: str) -> None:
    parser.add_argument("--out", metavar="FILE",
                        help=f"write results to FILE as JSON Lines instead of printing{note}")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def cmd_chat(args) -> int:
    return run_chat(args.server, ChatOptions(args.model, args.system, args.max_tokens,
                                             args.temperature, args.priority))


def cmd_batch(args) -> int:
    batches = read_sources(args.sources, args.max_tokens, args.batch_size)
    submitted = submit(args.server, batches, args.model, args.priority)
    if not (args.wait or args.out):
        for b in submitted:
            print(b.id)
        ids = " ".join(b.id for b in submitted)
        print(f"submitted {len(submitted)} batch(es), {sum(b.num_requests for b in submitted)} "
              f"requests; follow with: orca-serve results {ids}", file=sys.stderr)
        return 0
    return _follow(args, submitted)


def cmd_results(args) -> int:
    batches = []
    for batch_id in args.ids:
        obj = get_status(args.server, batch_id)
        batches.append(Submitted(batch_id, int(obj.get("num_requests", 0))))
    return _follow(args, batches)


def _follow(args, batches: list[Submitted]) -> int:
    sink = ResultSink(args.out)
    try:
        follow(args.server, batches, sink,
               show_progress=not args.no_progress and sys.stderr.isatty())
    except KeyboardInterrupt:
        ids = " ".join(b.id for b in batches)
        print(f"\nstopped following; the batches keep running on the server.\n"
              f"  results: orca-serve results {ids}\n  stop them: orca-serve cancel {ids}",
              file=sys.stderr)
        return 130
    finally:
        sink.close()
    if sink.num_failed:
        print(f"orca-serve: {sink.num_failed} request(s) failed or have no result",
              file=sys.stderr)
        return 1
    return 0


def cmd_status(args) -> int:
    for batch_id in args.ids:
        print(status_line(get_status(args.server, batch_id)))
    return 0


def cmd_cancel(args) -> int:
    for batch_id in args.ids:
        print(status_line(get_status(args.server, batch_id, method="DELETE")))
    return 0


def cmd_finetune(args) -> int:
    hyper = {k: v for k, v in [("n_epochs", args.epochs), ("batch_size", args.batch_size),
                               ("learning_rate", args.learning_rate)] if v is not None}
    options = {"suffix": args.suffix, "hyperparameters": hyper,
               **({"lora": {"r": args.rank}} if args.rank else {})}
    return run_finetune(args.server, args.file, args.model, options, args.wait,
                        not args.no_progress and sys.stderr.isatty())


COMMANDS = {"chat": cmd_chat, "batch": cmd_batch, "results": cmd_results,
            "status": cmd_status, "cancel": cmd_cancel, "finetune": cmd_finetune,
            "finetune-status": lambda args: job_status(args.server, args.job),
            "finetune-cancel": lambda args: job_status(args.server, args.job, cancel=True)}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.server = Server(args.url.rstrip("/"), args.api_key or None)
    try:
        if not args.server.url.startswith(("http://", "https://")):
            raise CLIError(f"--url must start with http:// or https://, got {args.url!r}",
                           USAGE_ERROR)
        try:
            httpx.URL(args.server.url)
        except httpx.InvalidURL as e:
            raise CLIError(f"--url {args.url!r} is not a valid URL: {e}", USAGE_ERROR) from None
        return COMMANDS[args.command](args)
    except CLIError as e:
        print(f"orca-serve: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("\norca-serve: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
