"""Errors the user caused and fixes from the command line, told apart from bugs.

A bad flag value, data file, checkpoint or output folder raises one of the ``UsageError``
classes below (each also the built-in type a caller would expect, so ``except ValueError`` still
catches a malformed data line). The command-line scripts print such an error, and a flag argparse
cannot parse (``CommandLineParser``), as one ``error: ...`` line and exit with code 2 (``--debug``
shows the traceback); any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import sys


class UsageError(Exception):
    """An error in what the user asked for; its message names the thing and the fix."""


class UsageValueError(UsageError, ValueError):
    pass


class UsageFileNotFoundError(UsageError, FileNotFoundError):
    pass


class UsageFileExistsError(UsageError, FileExistsError):
    pass


@contextlib.contextmanager
def command_line_errors(debug: bool = False):
    """Inside, a ``UsageError`` becomes ``error: <message>`` on stderr and exit code 2 (re-raised
    with its traceback when ``debug``)."""
    try:
        yield
    except UsageError as e:
        if debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


class CommandLineParser(argparse.ArgumentParser):
    """argparse whose refusals read as every other usage error: one ``error:`` line (no usage
    block) and exit code 2."""

    def error(self, message: str):
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)
