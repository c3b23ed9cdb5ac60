"""Supervised warm-up of the tiny model on a built-in task (`arithmetic`, `arithmetic_cot`), cached on disk by
its settings.

RL needs a policy that is sometimes right: the warm-up stops at a target held-out sampled accuracy, well below
100%, so RL has room to show gains and starts from about the same accuracy on any CPU.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import time
import warnings
import zlib
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from torch import nn

from lit_rlvr.config.errors import ConfigError
from lit_rlvr.config.options import range_problems
from lit_rlvr.config.settings import POSITIVE, ModelConfig, at_least

from lit_rlvr.data.tasks.arithmetic import ArithmeticTask, arithmetic_reward
from lit_rlvr.data.tasks.arithmetic_cot import ArithmeticCoTTask, arithmetic_cot_reward
from lit_rlvr.envs import build_environment
from lit_rlvr.envs.calculator import demonstration
from lit_rlvr.models import load_policy, tiny
from lit_rlvr.rollout.engine import SamplingParams
from lit_rlvr.rollout.hf import HFEngine
from lit_rlvr.rollout.multi_turn import MultiTurn
from lit_rlvr.run import cache_entry

try:
    import fcntl
except ImportError:  # pragma: no cover  (not POSIX)
    fcntl = None

log = logging.getLogger(__name__)


def sft_batch(tokenizer, examples: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded prompt+answer+eos ids [B, L], attention mask [B, L], labels [B, L] (-100 off the answer, and off
    the segments an example marks as not written by the model: a tool's results)."""
    rows, label_rows = [], []
    for ex in examples:
        prompt = tokenizer(ex["prompt"])["input_ids"]
        # arithmetic_cot: the written working and the marked answer; with a tool: (text, trained) segments
        segments = ex.get("segments") or [(ex.get("target", str(ex["answer"])), True)]
        target, labels = [], []
        for text, trained in segments:
            ids = tokenizer(text)["input_ids"]
            target += ids
            labels += ids if trained else [-100] * len(ids)
        rows.append(prompt + target + [tokenizer.eos_token_id])
        label_rows.append([-100] * len(prompt) + labels + [tokenizer.eos_token_id])
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (r, lab) in enumerate(zip(rows, label_rows)):
        ids[i, : len(r)], labels[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), torch.tensor(lab), 1
    return ids, mask, labels


# the warm-up's numeric settings (`model.options` of model=tiny) and their ranges, checked with train.py's config and
# when the warm-up starts (every entry point), one line each; the head width is hidden_size / 4 (`tiny.tiny_config`)
WARMUP_RANGES = {f"model.options.{key}": rule for key, rule in {
    "max_steps": at_least(1), "eval_every": at_least(1), "eval_problems": at_least(1), "eval_samples": at_least(1),
    "batch_size": at_least(1), "lr": POSITIVE, "warmup_steps": at_least(0), "layers": at_least(1),
    "split_seed": at_least(0), "max_new_tokens": at_least(1),
    "hidden_size": ((lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 8 and v % 8 == 0),
                    "a multiple of 8, >= 8 (4 attention heads of an even width)")}.items()}


def warmup_option_problems(options: dict[str, Any]) -> list[str]:
    """One line per `model.options` value of model=tiny that the warm-up cannot run with (its levels by its task)."""
    problems = range_problems({k: v for k, v in options.items() if k != "cache_dir"}, "model.options", WARMUP_RANGES)
    task, levels = options.get("task", "arithmetic"), options.get("levels")
    if not problems and levels is not None and task in WARMUP_TASKS:
        try:
            WARMUP_TASKS[task][0](levels=tuple(levels))
        except (TypeError, ValueError) as err:  # the task's own line, under this key
            problems.append(f"model.options.levels={list(levels)!r} is not valid"
                            f"{str(err).split(' is not valid', 1)[-1]}")
    return problems


def warm_start_tiny(
    cache_dir: str | Path,
    *,
    target: float = 0.30,
    max_steps: int = 2000,
    eval_every: int = 25,
    eval_problems: int = 256,
    eval_samples: int = 4,
    batch_size: int = 64,
    lr: float = 1e-3,
    warmup_steps: int = 80,
    seed: int = 0,
    levels: tuple[int, ...] = ArithmeticTask.levels,
    hidden_size: int = 64,
    layers: int = 2,
    split_seed: int = 0,
    task: str = "arithmetic",
    max_new_tokens: int = 8,
    tool_frac: float = 0.0,
) -> Path:
    """Path of the warmed-up tiny model; trains and saves it unless the same settings are cached.

    It trains on the train split of `ArithmeticTask(seed=split_seed)`, the split the datamodule evaluates on
    (`data.split_seed`), so RL's held-out problems are unseen whatever the model and run seeds. Training stops
    the first time the sampled accuracy (mean@`eval_samples` at T=1, checked every `eval_every` steps on
    `eval_problems` problems of a dev slice of the train split that the warm-up never trains on and RL never
    evaluates on) reaches `target`, or after `max_steps` with a warning: a step count alone lands at different
    accuracies on different CPUs (float order, compounded near a fast-learning phase). `warmup.json` in the
    folder records where it stopped. `task` is `arithmetic` (answers only) or `arithmetic_cot` (the written
    working, then the marked answer); `max_new_tokens` bounds the checks' completions. `tool_frac` (arithmetic_cot):
    that share of the problems is written as a calculator call, its result and the answer (`env=calculator`), and
    the checks run with the calculator environment, as RL will.

    Several processes (torchrun ranks) may ask at once: the first takes a lock on the cache entry and trains,
    the others wait for it and load what it saved. The entry is complete or absent (`cache_entry`: written
    aside with a manifest of checksums, renamed, verified on every use; a corrupt one is rebuilt, with a
    warning naming it); where the lock is unavailable, e.g. across hosts on some network filesystems, the
    first rename wins.
    """
    ConfigError.check(warmup_option_problems(dict(
        max_steps=max_steps, eval_every=eval_every, eval_problems=eval_problems, eval_samples=eval_samples,
        batch_size=batch_size, lr=lr, warmup_steps=warmup_steps, levels=levels, hidden_size=hidden_size, layers=layers,
        split_seed=split_seed, task=task, max_new_tokens=max_new_tokens)))
    if not 0.0 < target <= 1.0:
        raise ValueError(f"model.options.target={target} must be in (0, 1]: the held-out sampled accuracy to stop at")
    if task not in WARMUP_TASKS:
        raise ValueError(f"model.options.task={task!r} is not valid; valid: {', '.join(WARMUP_TASKS)}")
    if not 0.0 <= tool_frac < 1.0 or (tool_frac > 0 and task != "arithmetic_cot"):
        raise ValueError(f"model.options.tool_frac={tool_frac} must be in [0, 1), and 0 unless the task is "
                         f"arithmetic_cot (env=calculator's warm-up format is for data=arithmetic_cot)")
    settings = dict(target=target, max_steps=max_steps, eval_every=eval_every, eval_problems=eval_problems,
                    eval_samples=eval_samples, batch_size=batch_size, lr=lr, warmup_steps=warmup_steps, seed=seed,
                    levels=list(levels), hidden_size=hidden_size, layers=layers, split_seed=split_seed, version=4,
                    kernels=kernel_family())
    if task != "arithmetic":  # the default's key stays as it was, so its cached models stay valid
        settings.update(task=task, max_new_tokens=max_new_tokens)
    if tool_frac > 0:  # the keys of models warmed up without the tool stay as they were
        settings.update(tool_frac=tool_frac)
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    root = cache_entry.cache_root(cache_dir)
    path = root / f"tiny-{key}"
    problem = cache_entry.verify(path) if path.exists() else None
    if path.exists() and problem is None:
        return path
    cache_entry.prepare(root, cache_dir, path, problem)
    with _locked(path.with_name(f"{path.name}.lock")):
        problem = cache_entry.verify(path) if path.exists() else None
        if path.exists() and problem is None:  # another process trained it while this one waited
            return path
        if problem is not None:
            cache_entry.discard(path, problem)
        cache_entry.sweep(path)
        log.info("warm-starting the tiny model (to held-out mean@%d %.2f, at most %d steps) into %s",
                 eval_samples, target, max_steps, path)
        with torch.random.fork_rng(devices=[]), one_thread():  # the caller's RNG: not dependent on a warm cache
            model, tokenizer, record = _train(settings)
        record = {**settings, **record}
        _warn_if_capped(record)

        def fill(folder: Path) -> None:
            tiny.save(model, tokenizer, folder)
            (folder / RECORD_FILE).write_text(json.dumps(record, indent=2))

        needed = sum(p.numel() * p.element_size() for p in model.parameters()) + (1 << 20)  # + tokenizer, configs
        cache_entry.write_entry(path, fill, needed, cache_dir)
    return path


def kernel_family() -> str:
    """What the warm-up's floats still depend on with one thread: torch's version and the CPU kernels it picks
    (AVX-512, AVX2, ...). Part of the cache key, so a cache shared by two kinds of machine holds one entry each."""
    return f"torch {torch.__version__.split('+')[0]}, {torch.backends.cpu.get_cpu_capability()}"


@contextmanager
def one_thread() -> Iterator[None]:
    """The warm-up on one torch thread: a thread count splits the checks' sampling matmuls differently, so their
    log-probs (and, rarely, a sampled token) differ in the last bits, and with them the check where the warm-up
    first reaches its target; one thread gives the same stopping point on every machine of one kernel family."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


RECORD_FILE = "warmup.json"
# task name -> (task class, reward)
WARMUP_TASKS = {"arithmetic": (ArithmeticTask, arithmetic_reward),
                "arithmetic_cot": (ArithmeticCoTTask, arithmetic_cot_reward)}


def tiny_option_names() -> list[str]:
    """`model.options` of the built-in tiny model (its warm-up's arguments), besides `cache_dir`."""
    return [k for k in inspect.signature(warm_start_tiny).parameters if k != "cache_dir"]


def resolve_model_path(name_or_path: str, options: dict[str, Any] | None = None) -> str:
    """`tiny` -> the warm-started tiny model (built on first use); anything else is an HF path or hub name."""
    options = dict(options or {})
    if name_or_path == "tiny":
        cache_dir = options.pop("cache_dir", None)  # "" stays "": an empty LIT_RLVR_CACHE is refused, not the cwd
        cache_dir = cache_entry.default_cache_dir() if cache_dir is None else cache_dir
        valid = tiny_option_names()
        unknown = sorted(set(options) - set(valid))
        if unknown:  # e.g. `steps` from before the warm-up stopped at a target accuracy
            raise ValueError(f"model.options.{unknown[0]} is not an option of the tiny model; "
                             f"valid: {', '.join(valid)}")
        return str(warm_start_tiny(cache_dir, **options))
    local = Path(name_or_path).expanduser()
    if name_or_path.startswith((".", "/", "~")) and not local.exists():
        raise FileNotFoundError(f"model.name_or_path={name_or_path!r}: no such directory")
    return str(local) if local.exists() else name_or_path


def load_model(model: Any, tokenizer: Any, config: ModelConfig) -> tuple[nn.Module, Any, Optional[str]]:
    """(policy, tokenizer, path): `model` itself with its `tokenizer` when it is an `nn.Module` (a notebook; no
    path), else `config.name_or_path` resolved (`resolve_model_path`) and loaded in `config.dtype`."""
    if isinstance(model, nn.Module):
        if tokenizer is None:
            raise ConfigError([f"model={type(model).__name__}: an nn.Module needs its tokenizer (tokenizer=...)"])
        return model, tokenizer, None
    path = resolve_model_path(config.name_or_path, config.options)
    return (*load_policy(path, config.dtype), path)


def _warn_if_capped(record: dict) -> None:
    if record["reached"]:
        return
    message = (f"the tiny model's warm-up hit its step cap (model.options.max_steps={record['max_steps']}) at held-out "
               f"sampled accuracy {record['accuracy']:.3f}, below model.options.target={record['target']}: RL starts "
               f"lower than the README's figures; raise model.options.max_steps or lr")
    log.warning(message)
    warnings.warn(message, stacklevel=3)


@contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """An exclusive advisory lock (flock) held for the block; none where flock is not available."""
    with open(lock_path, "a") as handle:  # closing the file releases the lock
        if fcntl is not None:
            with suppress(OSError):  # a filesystem without flock: the rename still keeps the cache whole
                fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def dev_problems(task: ArithmeticTask, count: int) -> list[dict]:
    """`count` problems of the warm-up's dev slice: train-split problems the warm-up never trains on (RL's
    held-out evaluation uses the test split, so it never sees them either)."""
    found, index = [], 0
    while len(found) < count:
        problem = task.problem(index, "train")
        if _in_dev_slice(task, problem["prompt"]):
            found.append(problem)
        index += 1
    return found


def _in_dev_slice(task: ArithmeticTask, prompt: str) -> bool:
    return zlib.crc32(f"warmup-dev:{task.seed}:{prompt}".encode()) % 100 < DEV_PERCENT


DEV_PERCENT = 5  # of the train split's problems (a few hundred per level)


def _training_problems(task: ArithmeticTask, tool_frac: float = 0.0) -> Iterator[dict]:
    """The train split in order, without the dev slice; a `tool_frac` share (by a hash of the problem) written
    with the calculator tool."""
    index = 0
    while True:
        problem = task.problem(index, "train")
        if not _in_dev_slice(task, problem["prompt"]):
            if tool_frac and zlib.crc32(f"tool:{problem['prompt']}".encode()) % 10_000 < tool_frac * 10_000:
                problem = {**problem, "segments": demonstration(problem["prompt"].rstrip("="))}
            yield problem
        index += 1


@torch.no_grad()
def sampled_accuracy(model, tokenizer, problems: list[dict], samples: int, seed: int = 0, *,
                     reward=arithmetic_reward, max_new_tokens: int = 8, env: str = "none") -> float:
    """mean@`samples` at T=1 over `problems`, sampled as RL's held-out evaluation samples (`HFEngine`, batched);
    with `env` (calculator), multi-turn rollouts scored by the environment."""
    engine = HFEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id)
    prompts = [tokenizer(p["prompt"])["input_ids"] for p in problems]
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, seed=seed)
    if env != "none":
        environment = build_environment(env, {"options": {"reward": reward}, "max_tokens": 2 * max_new_tokens})
        episodes = MultiTurn(environment, tokenizer).run(engine.generate, prompts, [p["prompt"] for p in problems],
                                                         [p["answer"] for p in problems], [samples] * len(prompts),
                                                         params)
        return sum(e.reward > 0 for e in episodes) / len(episodes)
    completions = engine.generate(prompts, [samples] * len(prompts), params)
    correct = [reward(p["prompt"], tokenizer.decode(c.token_ids, skip_special_tokens=True),
                                 p["answer"]).score > 0 for p, per in zip(problems, completions) for c in per]
    return sum(correct) / len(correct)


def _train(s: dict):
    """The supervised warm-up itself: (model, tokenizer, record) after AdamW steps on the train split until the
    dev slice's sampled accuracy reaches s["target"] or s["max_steps"] pass. Linear LR warm-up, then constant:
    the schedule must not depend on where it stops."""
    model, tokenizer = tiny.build_tiny(s["seed"], hidden_size=s["hidden_size"], layers=s["layers"])
    task_class, reward = WARMUP_TASKS[s.get("task", "arithmetic")]
    task = task_class(levels=tuple(s["levels"]), seed=s["split_seed"])
    dev = dev_problems(task, s["eval_problems"])
    stream = _training_problems(task, s.get("tool_frac", 0.0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=s["lr"], weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / max(s["warmup_steps"], 1)))
    accuracy, step, history, eval_s, started = 0.0, 0, [], 0.0, time.perf_counter()
    while step < s["max_steps"]:
        model.train()
        ids, mask, labels = sft_batch(tokenizer, [next(stream) for _ in range(s["batch_size"])])
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        step += 1
        if step % s["eval_every"] == 0 or step == s["max_steps"]:
            model.eval()
            checked = time.perf_counter()
            with_tool = {"env": "calculator"} if s.get("tool_frac") else {}  # checked as RL will sample
            accuracy = sampled_accuracy(model, tokenizer, dev, s["eval_samples"], reward=reward,
                                        max_new_tokens=s.get("max_new_tokens", 8), **with_tool)
            eval_s += time.perf_counter() - checked
            history.append([step, round(accuracy, 4)])
            log.info("warm-up step %d: dev mean@%d %.3f (target %.2f)", step, s["eval_samples"], accuracy, s["target"])
            if accuracy >= s["target"]:
                break
    model.eval()
    record = dict(steps=step, accuracy=accuracy, reached=accuracy >= s["target"], history=history,
                  threads=torch.get_num_threads(), wall_s=round(time.perf_counter() - started, 1),
                  eval_s=round(eval_s, 1))  # the checks' share of the time
    return model, tokenizer, record
