"""The ``agentruns`` command line (SPEC §8). ``main(argv)`` returns the exit code.

Every failure is one line on stderr: exit 2 for bad input, 1 for the rest. This
module imports little: the rest is imported once ``main`` runs, where a Ctrl-C
during those imports (a second or so) is said in one line.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Iterator, Sequence


class _OneLine(logging.Formatter):
    """Log records without tracebacks: the CLI promises one line per problem."""

    def format(self, record: logging.LogRecord) -> str:
        record.exc_info = None
        record.exc_text = None
        return super().format(record)


@contextlib.contextmanager
def _quiet_logging() -> Iterator[None]:
    """One-line log records on stderr while a command runs; the caller's logging after."""
    root = logging.getLogger()
    leases = logging.getLogger("agentruns.leases")
    saved = (root.handlers[:], root.level, leases.level)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_OneLine("agentruns: %(levelname)s: %(message)s"))
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    # The abort listener's reconnect notices are for workers' logs, not a command's output.
    leases.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        leases.setLevel(saved[2])


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # before a command began: while its modules were imported
        print("agentruns: interrupted", file=sys.stderr)
        return 130


def _main(argv: Sequence[str] | None) -> int:
    from agentruns.cli.parser import build
    from agentruns.runs import is_utf8

    words = sys.argv[1:] if argv is None else list(argv)
    # Bytes that are not UTF-8 reach Python as lone surrogates: no store can keep them.
    bad = next((word for word in words if not is_utf8(word)), None)
    if bad is not None:
        print(f"agentruns: error: argument {bad!r} is not valid UTF-8", file=sys.stderr)
        return 2
    try:
        args = build().parse_args(words)
    except SystemExit as exc:  # --help, or a usage error already printed
        return exc.code if isinstance(exc.code, int) else 2
    with _quiet_logging():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from agentruns.cli.errors import describe
    from agentruns.cli.render import plain
    from agentruns.cli.session import Session

    session = Session(as_json=args.json)
    try:
        code: int = args.handler(session, args)
        session.close()
        return code
    except BrokenPipeError:  # the reader went away (`agentruns watch | head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        session.close()
        return 0
    except KeyboardInterrupt:
        try:
            session.close(interrupted=True)  # drains: its runs settle interrupted
        except KeyboardInterrupt:
            # A second Ctrl-C while the drain waits (for a tool call, say): leave now,
            # not after the calls in flight. recover picks their runs up once their
            # claims expire.
            with contextlib.suppress(Exception):
                sys.stdout.flush()
            print("agentruns: interrupted", file=sys.stderr, flush=True)
            os._exit(130)
        print("agentruns: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        with contextlib.suppress(Exception):
            session.close()
        settings = session.settings_or_none()
        code, line = describe(
            exc,
            settings.database_url if settings else "",
            settings.redis_url if settings else None,
        )
        print(f"agentruns: error: {plain(line)}", file=sys.stderr)
        return code


__all__ = ["main"]
