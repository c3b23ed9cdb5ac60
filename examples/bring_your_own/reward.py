"""A reward of your own for `python train.py reward.name=examples.bring_your_own.reward:close_enough`.

Any importable `module:function` works (a file in the directory you run from, or on PYTHONPATH). The function
gets one completion at a time and returns a `RewardResult(score, malformed)`; a raise, a timeout or a
non-finite score makes that rollout malformed with `failure_score` and is counted, the run goes on.
"""

import re

from lit_rlvr.rewards import RewardResult

_FIRST_INT = re.compile(r"\s*(-?\d+)")


def close_enough(prompt: str, completion: str, answer: str) -> RewardResult:
    """+1 for the right number, 0 when it is off by one, -1 otherwise; malformed when the completion does
    not start with a number."""
    match = _FIRST_INT.match(completion)
    if match is None:
        return RewardResult(-1.0, malformed=True)
    error = abs(int(match.group(1)) - int(answer))
    return RewardResult(1.0 if error == 0 else 0.0 if error == 1 else -1.0, malformed=False)
