"""`RLVRDataModule`: prompt batches for training and held-out evaluation.

A batch is a dict of lists, `{"prompt": [...], "answer": [...]}` (prompts are strings or chat messages);
rendering and tokenization happen in the module, which owns the tokenizer.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from lit_rlvr.config.bounds import answer_budget_problems
from lit_rlvr.config.errors import ConfigError, DataError
from lit_rlvr.config.settings import DataConfig
from lit_rlvr.data.formats import as_messages, load_records
from lit_rlvr.data.lengths import long_rows, token_limit
from lit_rlvr.data.tasks.arithmetic import ArithmeticTask
from lit_rlvr.data.tasks.arithmetic_cot import ArithmeticCoTTask
from lit_rlvr.run.step_count import rescale_epoch_batches

TASKS = {"arithmetic": ArithmeticTask, "arithmetic_cot": ArithmeticCoTTask}  # data.task -> built-in task

log = logging.getLogger(__name__)


class ArithmeticDataset(Dataset):
    """`size` problems of one split of the arithmetic task, drawn lazily (a problem is a function of its index)."""

    def __init__(self, task: ArithmeticTask | ArithmeticCoTTask, size: int, split: str):
        self.task, self.size, self.split = task, size, split

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.task.problem(index, self.split)


class RecordDataset(Dataset):
    """Records read from `source`; `rows` holds each record's 1-based row in that file (for error messages)."""

    def __init__(self, records: list[dict[str, Any]], source: str = "", rows: Optional[list[int]] = None):
        self.records, self.source = records, source
        self.rows = rows if rows is not None else list(range(1, len(records) + 1))

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.records[index]


class PromptedDataset(Dataset):
    """`dataset` with `with_instruction` applied to each row's prompt (the rows are not copied up front)."""

    def __init__(self, dataset: Dataset, instruction: Optional[str], system_prompt: Optional[str]):
        self.dataset, self.instruction, self.system_prompt = dataset, instruction, system_prompt

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        row = self.dataset[index]
        return {**row, "prompt": with_instruction(row["prompt"], self.instruction, self.system_prompt)}


def with_instruction(prompt: Any, instruction: Optional[str] = None, system_prompt: Optional[str] = None) -> Any:
    """`instruction` appended to the last user turn (as `formats.render_prompt` does); `system_prompt` added as
    the first message unless there is a system message. A string prompt stays a string unless a system
    prompt turns it into messages."""
    messages = as_messages(prompt, instruction, system_prompt)
    return messages[0]["content"] if isinstance(prompt, str) and len(messages) == 1 else messages


class ResumableSampler(Sampler[int]):
    """Shuffled indices whose order is a pure function of (seed, epoch), so a resumed run can skip the ones
    already trained on (`skip_next`) and continue with exactly the batches an uninterrupted run would see.
    Lightning calls `set_epoch` at every epoch start. With `world` data-parallel ranks, rank r takes every
    world-th index of the one global order, so the ranks' batches together are the 1-rank run's batch."""

    def __init__(self, size: int, seed: int, rank: int = 0, world: int = 1):
        self.size, self.seed, self.epoch = size, seed, 0
        self.rank, self.world = rank, world
        self._skip: dict[int, int] = {}  # epoch -> global indices to skip at its start (set on resume)

    def __len__(self) -> int:
        return self.size // self.world

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def skip_next(self, epoch: int, count: int) -> None:
        self._skip = {epoch: count}

    def order(self, epoch: int) -> list[int]:
        """This rank's indices of `epoch` from its start, whatever was skipped: what a fresh sampler yields."""
        return self._this_rank(self._global_order(epoch))

    def __iter__(self):
        yield from self._this_rank(self._global_order(self.epoch)[self._skip.pop(self.epoch, 0):])

    def _global_order(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.size, generator=generator).tolist()

    def _this_rank(self, order: list[int]) -> list[int]:
        return order[self.rank : len(order) - len(order) % self.world : self.world]


def collate(rows: list[dict[str, Any]]) -> dict[str, list]:
    return {"prompt": [r["prompt"] for r in rows], "answer": [r["answer"] for r in rows]}


# the data settings' defaults (lit_rlvr.config.settings.DataConfig): the constructor's, the Lightning CLI's and Python's
DEFAULT = DataConfig()


class RLVRDataModule(pl.LightningDataModule):
    """Built-in task (`task="arithmetic"` or `"arithmetic_cot"`) or records from files (`path=...`, see data.formats).

    Args: `batch_size` prompts per RL step over all ranks (each of W data-parallel ranks loads batch_size / W);
    `seed` the order of training prompts; `split_seed` the arithmetic train/test split (keep it equal to the tiny
    model's warm-up split, 0, so held-out problems are unseen); `eval_batch_size` prompts per validation batch;
    `num_train`/`num_test` arithmetic problems per split; `path`/`eval_path` training/evaluation files; `fields` a
    field mapping or preset name (`eval_fields` for the `eval_path` file when its columns differ);
    `max_prompt_chars` length filter; `max_prompt_tokens` token limit of a file's prompts (null: the model's context
    minus `max_new_tokens`; checked by `check_prompt_tokens`); `on_bad_row` "error" | "skip"; `eval_limit` first N
    evaluation prompts; `instruction` text appended to every prompt's last user turn (e.g.
    `formats.MATH_INSTRUCTION`) and `system_prompt` a system message added to prompts without one (both for
    training and evaluation); `answer_tokens` about how many tokens a completion of this data needs (a smaller
    `algorithm.max_new_tokens` is refused). The defaults and ranges are `DataConfig`'s (one per setting).
    """

    def __init__(
        self,
        task: Optional[str] = DEFAULT.task,
        batch_size: int = DEFAULT.batch_size,
        eval_batch_size: int = DEFAULT.eval_batch_size,
        seed: int = DEFAULT.seed,
        split_seed: int = DEFAULT.split_seed,
        levels: tuple[int, ...] = DEFAULT.levels,
        num_train: int = DEFAULT.num_train,
        num_test: int = DEFAULT.num_test,
        path: Optional[str] = DEFAULT.path,
        eval_path: Optional[str] = DEFAULT.eval_path,
        format: str = DEFAULT.format,
        split: str = DEFAULT.split,
        eval_split: str = DEFAULT.eval_split,
        fields: Optional[Any] = DEFAULT.fields,
        eval_fields: Optional[Any] = DEFAULT.eval_fields,
        max_prompt_chars: Optional[int] = DEFAULT.max_prompt_chars,
        max_prompt_tokens: Optional[int] = DEFAULT.max_prompt_tokens,
        on_bad_row: str = DEFAULT.on_bad_row,
        eval_limit: Optional[int] = DEFAULT.eval_limit,
        instruction: Optional[str] = DEFAULT.instruction,
        system_prompt: Optional[str] = DEFAULT.system_prompt,
        answer_tokens: Optional[int] = DEFAULT.answer_tokens,
    ):
        super().__init__()
        self.save_hyperparameters()  # Lightning's copy, for the loggers
        # the arguments, typed (the Lightning CLI adds keys of its own to hparams)
        # (each value checked against its rule: one line naming the key, before any work)
        self.config = DataConfig(**{f.name: self.hparams[f.name] for f in dataclasses.fields(DataConfig)})
        if task is not None and task not in TASKS:
            raise ConfigError([f"data.task={task!r} is not valid; valid: {', '.join(TASKS)} (or data.path for "
                               "files)"])
        if task is not None and path is None:
            TASKS[task](levels=self.config.levels, seed=self.config.split_seed)  # its levels: named now, not at setup
        self._sources: tuple[Dataset, ...] = ()  # (train, eval) as loaded, before `_wrap`
        self.train_set: Optional[Dataset] = None
        self.eval_set: Optional[Dataset] = None
        self.load_stats: dict[str, Any] = {}
        # training prompts (all ranks) consumed in the current epoch: in prompts, not batches, so that a resume with
        # another data.batch_size (resume_allow) continues after exactly the prompts trained on
        self._position = {"epoch": 0, "prompts": 0}
        self._saved_batch_size: Optional[int] = None  # the batch size of the checkpoint a resume restored
        self._sampler: Optional[ResumableSampler] = None

    def _load(self, path: str, split: str, fields: Any) -> RecordDataset:
        hp = self.config
        rows: list[int] = []
        records, stats = load_records(path, format=hp.format, split=split, fields=fields, row_numbers=rows,
                                      on_bad_row=hp.on_bad_row, max_prompt_chars=hp.max_prompt_chars)
        self.load_stats[path] = stats
        return RecordDataset(records, path, rows)

    def setup(self, stage: Optional[str] = None) -> None:
        hp = self.config
        self._check_budget()
        if self.train_set is not None:
            return
        if hp.path is not None:
            train = self._load(hp.path, hp.split, hp.fields)
            eval_fields = hp.fields if hp.eval_fields is None else hp.eval_fields
            self._sources = (train, self._load(hp.eval_path, hp.eval_split, eval_fields) if hp.eval_path else train)
            if not hp.eval_path and (self.trainer is None or self.trainer.global_rank == 0):
                log.warning("data.eval_path is not set: held-out evaluation uses the training file %s "
                            "(set data.eval_path=FILE for a separate set)", hp.path)
        else:
            task = TASKS[hp.task](levels=tuple(hp.levels), seed=hp.split_seed)
            self._sources = (ArithmeticDataset(task, hp.num_train, "train"),
                             ArithmeticDataset(task, hp.num_test, "test"))
        self._wrap()

    def _check_budget(self) -> None:
        """The module's response budget against the tokens this data's completions need (`answer_tokens`), one line
        before any step: the trainer holds both whatever the entry point (train.py checks it before any work too)."""
        module = self.trainer.lightning_module if self.trainer is not None else None
        budget = getattr(module, "response_budget", None)  # (tokens, the key that sets them)
        if budget is not None:
            ConfigError.check(answer_budget_problems(*budget, self.config.answer_tokens))

    def _wrap(self) -> None:
        """train_set / eval_set: the loaded sources with instruction, system prompt and eval_limit applied."""
        hp = self.config
        self.train_set, self.eval_set = self._sources
        if hp.instruction or hp.system_prompt:
            self.train_set = PromptedDataset(self.train_set, hp.instruction, hp.system_prompt)
            self.eval_set = PromptedDataset(self.eval_set, hp.instruction, hp.system_prompt)
        if hp.eval_limit is not None:
            self.eval_set = torch.utils.data.Subset(self.eval_set, range(min(hp.eval_limit, len(self.eval_set))))

    def check_prompt_tokens(self, render: Callable[[Any], str], tokenize: Callable[[str], list],
                            context: Optional[int], max_new_tokens: int,
                            budget_key: str = "algorithm.max_new_tokens") -> None:
        """File prompts longer than `max_prompt_tokens` (rendered by `render` as the module renders them) fail
        naming the file and row, or are dropped and counted with `on_bad_row=skip`. `max_new_tokens`: the response
        budget that shares the context (`budget_key`: env.max_tokens with an environment). The built-in task's
        prompts are short by construction and not checked."""
        hp = self.config
        limited = token_limit(hp.max_prompt_tokens, context, max_new_tokens, budget_key)
        if limited is None:  # neither a prompt limit nor the model's context is known
            self._wrap()
            return
        limit, origin = limited
        for source in dict.fromkeys(s for s in self._sources if isinstance(s, RecordDataset)):
            prompts = [with_instruction(r["prompt"], hp.instruction, hp.system_prompt) for r in source.records]
            found = long_rows(prompts, render, tokenize, limit)
            if found and hp.on_bad_row == "error":
                index, length = found[0]
                raise DataError(f"{source.source}: row {source.rows[index]}: the prompt has {length}, more than "
                                f"{limit} ({origin}); shorten it, or pass data.on_bad_row=skip "
                                f"({len(found)} rows of this file are too long)")
            if found:
                drop = {index for index, _ in found}
                source.records = [r for i, r in enumerate(source.records) if i not in drop]
                source.rows = [n for i, n in enumerate(source.rows) if i not in drop]
                stats = self.load_stats[source.source]
                stats["kept"] -= len(drop)
                stats["skipped"] += len(drop)
                stats["skipped_by_reason"]["prompt_tokens"] = len(drop)
                log.warning("%s: skipped %d rows whose prompts have more than %d tokens (%s)", source.source,
                            len(drop), limit, origin)
        self._wrap()

    def _ranks(self) -> tuple[int, int]:
        """(rank, world size); the data is split over ranks here, not by Lightning's distributed sampler."""
        trainer = self.trainer
        world = trainer.world_size if trainer is not None else 1
        if world > 1 and getattr(trainer._accelerator_connector, "use_distributed_sampler", False):
            raise ValueError("the lit-rlvr datamodule splits the global batch over ranks itself: set "
                             "trainer.use_distributed_sampler=false (conf/trainer/fsdp.yaml does)")
        return (trainer.global_rank if trainer is not None else 0), world

    def train_dataloader(self) -> DataLoader:
        hp = self.config
        rank, world = self._ranks()
        if hp.batch_size % world:
            raise ValueError(f"data.batch_size={hp.batch_size} (prompts per step, all ranks together) must be "
                             f"divisible by the {world} data-parallel ranks")
        if len(self.train_set) < hp.batch_size:  # drop_last: not one step's worth, the run would train on nothing
            stats = self.load_stats.get(hp.path, {"skipped": 0})
            raise DataError(f"{hp.path or 'the task'}: {len(self.train_set)} usable training rows ({stats['skipped']} "
                            f"skipped), fewer than one step's data.batch_size={hp.batch_size}; check data.fields (the "
                            "prompt and answer columns) and data.split")
        self._sampler = ResumableSampler(len(self.train_set), hp.seed, rank, world)
        if self._position["prompts"]:  # resumed mid-epoch: continue after the prompts already trained on
            self._sampler.skip_next(self._position["epoch"], self._position["prompts"])
        saved, self._saved_batch_size = self._saved_batch_size, None
        if saved not in (None, hp.batch_size) and self.trainer is not None and self.trainer.fit_loop.restarting:
            rescale_epoch_batches(self.trainer, saved, hp.batch_size)  # resumed with another data.batch_size
        # own generator: the loader's base-seed draw must not advance the global RNG (restored on resume)
        return DataLoader(self.train_set, batch_size=hp.batch_size // world, sampler=self._sampler,
                          collate_fn=collate, drop_last=True, generator=torch.Generator().manual_seed(hp.seed))

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Counts the training batches handed to the module (not the ones the loader prefetched)."""
        if self.trainer is not None and self.trainer.training:
            self.note_batches(1)
        return batch

    def note_batches(self, count: int) -> None:
        """`count` more training batches (of `batch_size` prompts over all ranks) consumed (a module that reads the
        data iterator itself calls this)."""
        epoch = self.trainer.current_epoch if self.trainer is not None else 0
        if epoch != self._position["epoch"]:
            self._position = {"epoch": epoch, "prompts": 0}
        self._position["prompts"] += count * self.config.batch_size

    def state_dict(self) -> dict[str, Any]:
        """The data position, saved in checkpoints by Lightning: resume continues with the next prompt."""
        return {**self._position, "batch_size": self.config.batch_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        prompts = state_dict.get("prompts")
        if prompts is None:  # a checkpoint that counted batches: of this batch size (a resume may not change it)
            prompts = int(state_dict.get("batches", 0)) * self.config.batch_size
        self._position = {"epoch": int(state_dict.get("epoch", 0)), "prompts": int(prompts)}
        self._saved_batch_size = state_dict.get("batch_size")  # None: a checkpoint from before it was recorded

    def val_dataloader(self) -> DataLoader:
        rank, world = self._ranks()  # each rank scores its share; the metrics are reduced by torchmetrics
        if world == 1:
            return DataLoader(self.eval_set, batch_size=self.config.eval_batch_size, shuffle=False, collate_fn=collate)
        # equal shards: every rank must run the same number of validation steps (each one pushes weights)
        usable = len(self.eval_set) - len(self.eval_set) % world
        if usable == 0:
            raise ValueError(f"the held-out set has {len(self.eval_set)} prompts, fewer than the {world} ranks: raise "
                             "data.num_test or data.eval_limit, or evaluate on fewer ranks")
        if usable < len(self.eval_set):
            log.warning("held-out set: the last %d of %d prompts are not scored, so the %d ranks get equal shares",
                        len(self.eval_set) - usable, len(self.eval_set), world)
        shard = torch.utils.data.Subset(self.eval_set, range(rank, usable, world))
        return DataLoader(shard, batch_size=self.config.eval_batch_size, shuffle=False, collate_fn=collate)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()
