"""Which training prompts come next, so V0.5 can compute their features ahead of the steps
(`ValuePrior(precompute="next")`): `TrainPrompts` reads the data loader, `Ahead` hands out aligned chunks."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from lit_rlvr.data.datamodule import ResumableSampler
from lit_rlvr.data.formats import render_prompt

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl


class TrainPrompts:
    """The training prompts as the module renders them: `prompts(indices)`, and each epoch's sample order
    (`order(epoch)`, None when the sampler's order cannot be known ahead)."""

    def __init__(self, dataset: Any, batch_size: int, render: Callable[[Any], str], sampler: Any) -> None:
        self.dataset, self.batch_size, self.render, self.sampler = dataset, batch_size, render, sampler
        from torch.utils.data import SequentialSampler

        if isinstance(sampler, ResumableSampler):  # a pure function of (seed, epoch): a fresh one from the start
            self.order: Optional[Callable[[int], list[int]]] = sampler.order
        elif isinstance(sampler, SequentialSampler):
            self.order = lambda epoch: list(range(len(dataset)))
        else:
            self.order = None

    @classmethod
    def of(cls, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> Optional["TrainPrompts"]:
        loader = getattr(trainer, "train_dataloader", None)
        dataset, batch_size = getattr(loader, "dataset", None), getattr(loader, "batch_size", None)
        if dataset is None or not batch_size or not hasattr(dataset, "__len__"):
            return None
        render = functools.partial(render_prompt, tokenizer=pl_module.tokenizer,
                                   chat_template=pl_module.settings.model.chat_template)  # as the module's plans
        return cls(dataset, batch_size, render, getattr(loader, "sampler", None))

    def __len__(self) -> int:
        return len(self.dataset)

    def prompts(self, indices: Sequence[int]) -> list[str]:
        rows = (self.dataset[i] for i in indices)
        return [self.render(row["prompt"] if isinstance(row, dict) else row) for row in rows]


class Ahead:
    """"next": the prompts of `steps` batches at a time, chunks aligned to multiples of `steps` batches in the
    epoch, so a resumed run computes the very chunks (and numbers) of the uninterrupted one."""

    def __init__(self, source: TrainPrompts, steps: int) -> None:
        self.source, self.steps = source, steps
        self.held: Optional[tuple[int, int]] = None  # (epoch, chunk) now held
        self._order: tuple[int, list[int]] = (-1, [])

    def chunk_for(self, epoch: int, batch_idx: int) -> Optional[list[str]]:
        """The prompts of the chunk holding batch `batch_idx` of `epoch`, or None when it is held already."""
        key = (epoch, batch_idx // self.steps)
        if key == self.held:
            return None
        if self._order[0] != epoch:
            self._order = (epoch, self.source.order(epoch))
        size = self.steps * self.source.batch_size
        self.held = key
        return self.source.prompts(self._order[1][key[1] * size : (key[1] + 1) * size])
