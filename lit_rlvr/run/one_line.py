"""Errors a user can fix, as one line from every entry point (`train.py`, `lit-rlvr-train`, `lit-rlvr`).

Two kinds reach the user as one line, without a traceback (`one_line_errors`; LIT_RLVR_DEBUG=1 shows it):
* configuration errors: a `ConfigError`/`CheckpointError`/`DataError`, and any ValueError, FileNotFoundError or
  ImportError raised while the run is being built (`config_phase`: constructors and checks, before any work);
* `StorageError` (from lit_rlvr/run/storage.py): a file of the run could not be written (disk full, quota,
  read-only or unwritable directory); the first one in the exception's chain is reported (later ones follow from it).

Python callers get the same exceptions, whose message is that line. The classes are in `lit_rlvr.config.errors`.
"""

from __future__ import annotations

import re
import sys
from typing import Optional

from lit_rlvr.config.errors import (DEBUG_ENV, CheckpointError, ConfigError, DataError, GenerationBudgetError,
                                     StorageError, debug)
from lit_rlvr.run.storage import storage_cause

_CONFIG_PHASE = "_lit_rlvr_config_phase"  # set on an exception raised while the run was being built


class config_phase:
    """Marks a ValueError, FileNotFoundError or ImportError raised inside the block (the run's constructors and
    checks, before any work) as a configuration error: the entry points print it as one line. The exception
    itself passes on unchanged (same type, same message) for Python callers."""

    KINDS = (ValueError, FileNotFoundError, ImportError)

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, err, tb) -> bool:
        if isinstance(err, self.KINDS):
            try:
                setattr(err, _CONFIG_PHASE, True)
            except AttributeError:  # an exception type with __slots__: left as it is
                pass
        return False


def one_line(err: BaseException) -> Optional[tuple[str, list[str]]]:
    """(label, lines) when `err` is one of the errors a user fixes; None for anything else (a bug: traceback)."""
    storage = None
    for current in _chain(err):  # the first storage failure: later ones follow from it
        if isinstance(current, StorageError):
            storage = current
    if storage is not None:
        return "error", [storage.message]
    cause, _ = storage_cause(err)  # written by a library without our wrapper (e.g. Lightning's own checkpoints)
    if cause is not None:
        where = next((e.filename for e in _chain(err) if isinstance(e, OSError) and e.filename), None)
        first = (str(err).splitlines() or [""])[0][:200]
        return "error", [f"{cause}: {where}" if where else f"{cause} ({type(err).__name__}: {first})"]
    if isinstance(err, GenerationBudgetError):  # raised mid-run: a stop, not a setting refused before any work
        return "stopped", list(err.problems)
    if isinstance(err, ConfigError):
        return "config error", list(err.problems)
    if getattr(err, _CONFIG_PHASE, False) or isinstance(err, (CheckpointError, DataError)):
        return "config error", str(err).splitlines() or [type(err).__name__]
    return None


def _chain(err: BaseException) -> list[BaseException]:
    """`err` and the exceptions it was raised from or during, newest first."""
    chain, seen, current = [], set(), err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def root_cause(err: BaseException) -> BaseException:
    """The exception at the end of `err`'s explicit `raise ... from` chain (a library's wrappers taken off)."""
    seen = {id(err)}
    while err.__cause__ is not None and id(err.__cause__) not in seen:
        err = err.__cause__
        seen.add(id(err))
    return err


class one_line_errors:
    """At an entry point: an error of `one_line` is printed on stderr as its line(s) and the process exits with
    code 2; anything else raises as usual. `key_prefixes` renames config keys for an entry point that spells
    them otherwise (the Lightning CLI: `algorithm.` -> `model.init_args.`)."""

    def __init__(self, key_prefixes: Optional[dict[str, str]] = None):
        self.key_prefixes = dict(key_prefixes or {})

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, err, tb) -> bool:
        if err is None or not isinstance(err, Exception) or debug():
            return False
        found = one_line(err)
        if found is None:
            return False
        label, lines = found
        for line in lines:
            print(f"{label}: {rename_keys(line, self.key_prefixes)}", file=sys.stderr)
        print(f"(set {DEBUG_ENV}=1 for the traceback)", file=sys.stderr)
        sys.stderr.flush()
        raise SystemExit(2)


def rename_keys(line: str, key_prefixes: dict[str, str]) -> str:
    """`line` with each key prefix replaced where a key starts (not inside another word or key)."""
    if not key_prefixes:
        return line
    pattern = "|".join(re.escape(k) for k in sorted(key_prefixes, key=len, reverse=True))
    return re.sub(rf"(?<![\w.])({pattern})", lambda m: key_prefixes[m.group(1)], line)
