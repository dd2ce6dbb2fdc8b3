"""Errors a user can act on.

Every exception here carries a message that says what to change. The CLI prints it as one
line and exits with a non-zero code instead of showing a traceback.
"""


import sys
from collections.abc import Callable


class DtrainError(Exception):
    """Base class of the errors dtrain raises for a user's mistake or environment."""

    exit_code = 1


class ConfigError(DtrainError):
    """A configuration value (file, `--set`, argument) is malformed or inconsistent."""

    exit_code = 2


class LaunchError(DtrainError):
    """Processes could not be started or a rank failed; `exit_code` is the failed rank's."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def exit_code_of(job: Callable[[], object]) -> int:
    """Run `job`; a DtrainError becomes one `dtrain: error:` line and its exit code."""
    try:
        job()
    except DtrainError as exc:
        print(f"dtrain: error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0
