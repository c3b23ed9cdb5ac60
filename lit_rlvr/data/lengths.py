"""Prompt length in tokens, checked when the data loads (docs/architecture.md §10): a prompt longer than the model's
context (minus the tokens it must generate) cannot be trained on; it used to run silently, or, at 10 MB,
reach a 100 GiB allocation minutes into the run."""

from __future__ import annotations

from typing import Any, Callable, Optional

from lit_rlvr.config.bounds import check_bounds

PREFIX_CHARS_PER_TOKEN = 8  # a long text is first tokenized only this many characters per allowed token


def token_limit(max_prompt_tokens: Optional[int], context: Optional[int], max_new_tokens: int,
                budget_key: str = "algorithm.max_new_tokens") -> Optional[tuple[int, str]]:
    """(limit, where it comes from): `data.max_prompt_tokens` when set, else the context minus the response budget
    (`max_new_tokens` of `budget_key`: env.max_tokens with an environment); None when neither is known. Both must
    fit the context together (lit_rlvr.config.bounds, the one rule)."""
    if max_prompt_tokens is not None:
        if max_prompt_tokens < 1:
            raise ValueError(f"data.max_prompt_tokens must be >= 1 (or null), got {max_prompt_tokens}")
        if context is not None:
            env_tokens = max_new_tokens if budget_key == "env.max_tokens" else None
            check_bounds(context, max_new_tokens=max_new_tokens, env_max_tokens=env_tokens,
                         max_prompt_tokens=max_prompt_tokens)
        return int(max_prompt_tokens), f"data.max_prompt_tokens={max_prompt_tokens}"
    if context is None:
        return None
    limit = context - max_new_tokens
    if limit < 1:
        raise ValueError(f"{budget_key}={max_new_tokens} leaves no room for a prompt in the model's "
                         f"context of {context} tokens")
    return limit, (f"the model's context {context} minus {budget_key}={max_new_tokens}; "
                   "set data.max_prompt_tokens to change it")


def over_limit(text: str, tokenize: Callable[[str], list], limit: int) -> Optional[str]:
    """None if `text` has at most `limit` tokens, else how many it has ("more than N" for a huge text).

    No tokenizer makes more tokens than UTF-8 bytes plus a couple of markers, so a short text is not tokenized;
    a long one is first tokenized by a prefix, so a 10 MB prompt is refused without tokenizing all of it."""
    if len(text.encode("utf-8", "surrogatepass")) + 2 <= limit:
        return None
    prefix = PREFIX_CHARS_PER_TOKEN * (limit + 2)
    if len(text) > prefix:
        counted = len(tokenize(text[:prefix]))
        if counted > limit + 1:  # a cut splits at most one token in two
            return f"more than {limit} tokens ({len(text)} characters)"
    counted = len(tokenize(text))
    return f"{counted} tokens" if counted > limit else None


def long_rows(prompts: list[Any], render: Callable[[Any], str], tokenize: Callable[[str], list],
              limit: int) -> list[tuple[int, str]]:
    """(index, length) of each prompt longer than `limit` tokens once rendered as the module renders it."""
    found = []
    for index, prompt in enumerate(prompts):
        length = over_limit(render(prompt), tokenize, limit)
        if length is not None:
            found.append((index, length))
    return found
