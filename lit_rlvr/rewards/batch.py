"""`BatchRewardRunner`: for rewards that score a whole batch themselves, through a `score_batch(prompts,
completions, answers) -> list` method (the code sandbox runs its own pool of sandboxes, a reward server batches its
requests, a reward model its forward passes). Each bounds its own calls (the sandbox's kills, the server's request
timeouts); the runner gives every completion its own copy of its arguments and applies the contract and the
failure rule to what comes back."""

from __future__ import annotations

from typing import Any

from lit_rlvr.config.errors import RewardOptionError, StopRequested
from lit_rlvr.rewards.base import CallError, RewardResult, Runner, copied, plain_result
from lit_rlvr.run.stop import STOP


class BatchRewardRunner(Runner):
    """A `score_batch` that raises, or returns a list of another length, makes every completion of the batch a
    counted failure; an element that is a `RewardResult` whose `info` starts with "error" is that completion's own
    failure (how the sandbox, a reward server and a reward model report a failed run, request or forward pass)."""

    def _score(self, jobs: list[tuple]) -> list[Any]:
        STOP.check()  # its own calls are bounded; a stop past its grace starts no new batch
        try:  # one copy per completion: scoring one cannot change what the next one (or a later step) sees
            copies = [copied(args) for args in jobs]
            results = list(self.fn.score_batch(*[[c[i] for c in copies] for i in range(3)]))
            if len(results) != len(copies):
                raise ValueError(f"score_batch returned {len(results)} results for {len(copies)} completions")
        except (StopRequested, RewardOptionError):  # a stop; a reward that cannot work (found when it loads)
            raise
        except BaseException as err:  # reward code is user code: every call of the batch fails, the run goes on
            return [CallError("score_batch raised", f"{type(err).__name__}: {str(err)[:500]}")] * len(jobs)
        results = [plain_result(r) for r in results]
        return [CallError("reported error", r.info[5:].lstrip(": ")) if isinstance(r, RewardResult)
                and r.info.startswith("error") else r for r in results]

    def close(self) -> None:
        getattr(self.fn, "close", lambda: None)()
