"""Errors a user can fix by changing the command, the config or the files: entry points print them as one
`error: ...` line and exit non-zero, without a traceback (HYDRA_FULL_ERROR=1 or --debug shows it).

Anything else is a programming error and keeps its traceback.
"""

from __future__ import annotations

import contextlib
import os
import sys

DEBUG_ENV = "HYDRA_FULL_ERROR"  # Hydra's own switch for full tracebacks; --debug sets it
EXIT_USER_ERROR = 2


class UserError(Exception):
    """A problem with what the run was given (config, data, checkpoint, environment); the message says what to do."""


class ConfigError(UserError, ValueError):
    """A config value, or a combination of values, that cannot run as asked."""


class DataError(UserError, ValueError):
    """The data at data.root (or a built-in set) is not what the loader needs."""


class DataNotFound(UserError, FileNotFoundError):
    """data.root, a split or a class directory is missing."""


class MissingDependency(UserError, ImportError):
    """An optional package the run asked for is not installed."""


def user_error_types() -> tuple[type[BaseException], ...]:
    """UserError, and the error types of modules that cannot depend on this one."""
    from .depthwise import BackendUnavailable

    return (UserError, BackendUnavailable)


def as_user_error(e: Exception) -> UserError:
    """The user-error twin of a ValueError / FileNotFoundError / ImportError raised while checking user input."""
    if isinstance(e, UserError):
        return e
    if isinstance(e, FileNotFoundError):
        return DataNotFound(str(e))
    if isinstance(e, ImportError):
        return MissingDependency(str(e))
    return ConfigError(str(e))


@contextlib.contextmanager
def checking_user_input(*types: type[Exception]):
    """Within this block, the given exception types mean bad user input: re-raise them as UserErrors.

    For calls into modules that validate the config but raise plain ValueError (streams, cuda_graph, loaders)."""
    try:
        yield
    except types as e:
        if isinstance(e, UserError):
            raise
        raise as_user_error(e) from e


def debug_requested() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def one_line(e: BaseException) -> str:
    """The message of `e` without the traceback that a DataLoader worker or DALI wraps around it."""
    text = str(e).strip() or type(e).__name__
    if "Original Traceback" in text:  # torch re-raises a worker's exception with the worker's traceback as its text
        last = text.splitlines()[-1]
        text = last.split(": ", 1)[1] if ": " in last else last
    return text


@contextlib.contextmanager
def report_user_errors(cleanup=None):
    """Print a user error as `error: ...` and exit with EXIT_USER_ERROR; other exceptions pass unchanged.

    `cleanup(exc)` runs first for any exception (e.g. to remove a run directory nothing was written to)."""
    try:
        yield
    except BaseException as e:
        if cleanup is not None:
            cleanup(e)
        if not isinstance(e, user_error_types()) or debug_requested():
            raise
        print(f"error: {one_line(e)}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_USER_ERROR) from None


def run_main(main) -> None:
    """A script's entry point: exit with main()'s status, a user error (a bad override, a missing folder) printed as
    one `error: ...` line (report_user_errors)."""
    with report_user_errors():
        sys.exit(main())
