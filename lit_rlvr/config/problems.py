"""The standard problem line of a bad setting and the general rules every setting follows (finite floats, known
keys, conversions that name the key), without torch: reward worker processes import it. `lit_rlvr.config.options`
re-exports them beside its table of ranges."""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import urllib.parse
from typing import Any, Iterable, Mapping, Optional

from lit_rlvr.config.errors import ConfigError


def problem_line(key: str, value: Any, expected: str) -> str:
    """The one line every entry point prints for a bad value."""
    shown = "???" if isinstance(value, str) and value == "???" else repr(value)  # OmegaConf's missing value
    return f"{key}={shown} is not valid: expected {expected}"


# The float settings where +inf means something (no bound); nan never does. Every other float setting, at any
# depth of any section, must be finite: an inf or nan passes every `v > 0` rule and fails steps later.
INFINITE_OK = frozenset({"algorithm.optimizer_options.clip_radius"})  # IVON: inf = no clipping (its default)


def finite_problem(key: str, value: Any) -> Optional[str]:
    """The problem line of a non-finite float `value` of setting `key`, else None (the one finiteness rule)."""
    if not isinstance(value, float) or math.isfinite(value):
        return None
    if math.isinf(value) and value > 0 and key in INFINITE_OK:
        return None
    return problem_line(key, value, "a finite number" + (" or inf" if key in INFINITE_OK else ""))


def finite_problems(values: Any, key: str) -> list[str]:
    """`finite_problem` for every float in `values` (a setting, or a section: nested mappings and lists), with
    dotted keys under `key` (list items as key.0, key.1, ...)."""
    if isinstance(values, Mapping):
        return [p for k, v in values.items() for p in finite_problems(v, f"{key}.{k}" if key else str(k))]
    if isinstance(values, (list, tuple)):
        return [p for i, v in enumerate(values) for p in finite_problems(v, f"{key}.{i}")]
    problem = finite_problem(key, values)
    return [problem] if problem else []


def check_finite(section: str, **values: Any) -> None:
    """For a constructor: `ConfigError` listing every non-finite float among `values` (keys under `section`)."""
    problems = finite_problems(values, section)
    ConfigError.check(problems)


NUMBER_NAMES = {int: "an integer", float: "a number", bool: "true or false"}


def convert(key: str, value: Any, kind: type, *, optional: bool = False, expected: Optional[str] = None) -> Any:
    """`value` as `kind` (int, float or bool), or a `ConfigError` whose line names `key`, the value and what is
    expected: where a setting's value is converted, never a bare int()/float() (whose error names no key).
    Accepts what a config or a command line gives: "8" for an int, 8 or "1e-3" for a float, true/false or
    "true"/"false" for a bool; an integral float for an int (8.0); not a bool for a number; floats must be finite
    (`finite_problem`). `optional`: None passes as None."""
    if value is None and optional:
        return None
    what = expected or NUMBER_NAMES[kind] + (" or null" if optional else "")
    out: Any = None
    if kind is bool:
        text = str(value).strip().lower() if isinstance(value, str) else None
        out = value if isinstance(value, bool) else {"true": True, "false": False}.get(text)
    elif not isinstance(value, bool) and isinstance(value, (int, float, str)):
        try:
            number = float(value) if kind is float else (int(value) if not isinstance(value, float) else value)
            if kind is int and isinstance(number, float):
                number = int(number) if number.is_integer() else None
            out = number
        except (TypeError, ValueError, OverflowError):
            out = None
    if out is None:
        raise ConfigError([problem_line(key, value, what)])
    problem = finite_problem(key, out) if kind is float else None
    if problem:
        raise ConfigError([problem])
    return out


def unknown_key_problems(section: str, given: Any, valid: Any, suggest: Any = ()) -> list[str]:
    """One line per key of `given` that `valid` lacks, naming it, a close match among `valid` and `suggest`
    (dotted names under `section`, e.g. "lora.rank") if there is one, and the valid keys."""
    valid, prefix = sorted(set(valid)), f"{section}." if section else ""
    problems = []
    for name in sorted(set(given) - set(valid)):
        close = difflib.get_close_matches(str(name), [*suggest, *valid], n=1, cutoff=0.6)
        hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
        problems.append(f"{prefix}{name} is not an option{hint}; valid: {', '.join(valid)}")
    return problems


def checked_fields(cls: type, value: Any, section: str, also: Iterable[str] = ()) -> dict[str, Any]:
    """`value`, None or a mapping of the fields of the settings dataclass `cls` (and of the keys `also`), as a dict;
    a value that is not a mapping, and each unknown key, is a `ConfigError` line naming it under `section`."""
    names = [f.name for f in dataclasses.fields(cls)]
    if value is not None and not isinstance(value, Mapping):
        raise ConfigError([problem_line(section, value, f"a mapping of {{{', '.join(names)}}} or null")])
    given = dict(value or {})
    ConfigError.check(unknown_key_problems(section, [k for k in given if k not in also], names))
    return given


_URL_PASSWORD = re.compile(r"(?i)\b[a-z][a-z0-9+.-]*://[^/\s@:]*:[^/\s@]*@")  # scheme://user:password@
SECRET_KEYS = ("api_key", "apikey", "password", "secret", "access_token", "auth_token", "bearer_token", "hf_token")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# a query parameter named so (or ending in _key, _token, ... or a SECRET_KEYS name) holds a secret
_QUERY_SECRETS = ("key", "token", "sig", "signature", "auth")
_QUERY_SECRET_ENDINGS = (*SECRET_KEYS, *(f"_{word}" for word in _QUERY_SECRETS))


def _query_secrets(value: str) -> list[str]:
    """Names of the query parameters of the URL `value` that hold a secret (`?api_key=...`), none for a non-URL."""
    if "://" not in value or "?" not in value:
        return []
    query = urllib.parse.urlsplit(value.strip()).query
    return [name for name, _ in urllib.parse.parse_qsl(query, keep_blank_values=True) if _names_a_secret(name)]


def _names_a_secret(name: str) -> bool:
    name = name.lower().replace("-", "_")
    return name in _QUERY_SECRETS or name.endswith(_QUERY_SECRET_ENDINGS)


def secret_problems(tree: Any, section: str = "") -> list[str]:
    """One line per setting under `tree` (a plain mapping) named like a secret (`SECRET_KEYS`, or ending in one):
    settings are written to hparams.yaml, the Hydra folder and the checkpoints, so a key never is one. The line
    names the setting, never its value."""
    problems = []
    items = tree.items() if isinstance(tree, Mapping) else enumerate(tree) if isinstance(tree, list) else ()
    for name, value in items:
        where = f"{section}.{name}" if section else str(name)
        if isinstance(name, str) and name.lower().endswith(SECRET_KEYS) and value is not None:
            problems.append(f"{where} holds a secret, and settings are written to hparams.yaml, the Hydra folder "
                            "and the checkpoints: give it through the environment or a file instead (reward=judge: "
                            "OPENAI_API_KEY, reward.options.api_key_env=NAME or reward.options.api_key_file=PATH)")
        elif isinstance(value, str) and _URL_PASSWORD.search(value):
            problems.append(f"{where} holds a password in its URL, and settings are written to hparams.yaml, the "
                            "Hydra folder and the checkpoints: drop it from the URL and put the login in ~/.netrc (or "
                            "the file $NETRC names), which the HTTP client reads for that host")
        elif isinstance(value, str) and (in_query := _query_secrets(value)):
            problems.append(f"{where} holds a secret in its URL's query ({', '.join(in_query)}), and "
                            "settings are written to hparams.yaml, the Hydra folder and the checkpoints: drop it from "
                            "the URL; a server that needs a login takes it from ~/.netrc (or the file $NETRC names)")
        elif isinstance(name, str) and name.lower().endswith("_env") and isinstance(value, str) \
                and not _ENV_NAME.fullmatch(value):
            problems.append(f"{where} is not the name of an environment variable (letters, digits and _, not "
                            "starting with a digit); if it is the secret itself, it must not be a setting (settings "
                            "are written to hparams.yaml, the Hydra folder and the checkpoints): export it as a "
                            f"variable and set {where}=THAT_NAME")
        else:
            problems += secret_problems(value, where)
    return problems
