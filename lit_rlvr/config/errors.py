"""Every error class of lit-rlvr, in one place, and the switch that shows their tracebacks (`LIT_RLVR_DEBUG=1`).

The errors a user fixes carry one line each (a key, its value and what is allowed; a file and what is wrong with
it); `lit_rlvr.run.one_line` prints them that way at the entry points. This module imports nothing else of lit-rlvr
and no torch: reward worker processes import it. Control-flow exceptions private to one module (a reward that is
not a score, a row that does not parse) stay beside their code.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

DEBUG_ENV = "LIT_RLVR_DEBUG"  # =1: config errors raise with their traceback instead of one line


def debug() -> bool:
    """Whether the user asked for tracebacks (`LIT_RLVR_DEBUG` set and not 0)."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


class ConfigError(ValueError):
    """Invalid option values: one line per key (`problems`); entry points print the lines without a traceback."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))

    def __reduce__(self):  # pickled (an engine's process sends it back): rebuilt from its lines, not its message
        return type(self), (self.problems,)

    @classmethod
    def check(cls, problems: list[str]) -> None:
        """Raises the `problems` a check found, if there are any."""
        if problems:
            raise cls(problems)


class GenerationBudgetError(ConfigError):
    """A step drew `max_num_gen_batches` generation batches and still lacks groups whose metric differs: the
    budget (or the data's difficulty for this policy), not a bug, is the cause; one line from every entry point."""


class MaskedStepError(ConfigError):
    """An update whose every loss term was masked to 0 (loss 0, gradient 0): the settings that mask, not the data,
    are the usual cause, so it stops the run as a config error (one line)."""


class NonFiniteError(RuntimeError):
    """`algorithm.max_bad_steps` non-finite steps in a row (each one skipped): the run stops."""


class RewardOptionError(ValueError):
    """Bad reward settings, one line each (`problems`); the entry points print them as config errors."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file, what is wrong and the key to change."""


class DataError(ValueError):
    """A bad data file or row; the message names the file, the 1-based row and the field, and the fix."""


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message names the feature and the pip command."""


class StorageError(OSError):
    """A file of the run could not be written; the message is one line: cause, path, what was needed."""

    def __init__(self, message: str, path: Path, cause_errno: Optional[int] = None):
        super().__init__(cause_errno, message)
        self.message, self.path = message, Path(path)

    def __str__(self) -> str:
        return self.message


class StopRequested(BaseException):
    """A stop request outlived the grace period mid-step (a BaseException: no `except Exception` contains it).
    `signal_name`: "SIGTERM" or "SIGINT"."""

    def __init__(self, signal_name: str, message: str):
        super().__init__(message)
        self.signal_name = signal_name


class RewardHangError(RuntimeError):
    """A reward call overran `reward.options.timeout_s` and could not be cut: the run stopped after saving."""


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the program): an infrastructure error, never a wrong answer."""


class HTTPRefusal(RuntimeError):
    """An answer lit-rlvr's HTTP client refuses (lit_rlvr/run/http.py), one line naming the URL with its credentials
    redacted. `kind`: "scheme" (not http/https), "redirect", "size" (over the bound), "deadline", "status" (an error
    status, `status`), "tls", "connection" (refused, dropped). `retry`: whether another try may succeed."""

    def __init__(self, message: str, kind: str, status: Optional[int] = None):
        super().__init__(message)
        self.kind, self.status = kind, status

    @property
    def retry(self) -> bool:
        return self.kind == "connection" or (self.kind == "status" and (self.status or 0) >= 500)

    def __reduce__(self):
        return type(self), (str(self), self.kind, self.status)
