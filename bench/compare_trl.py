"""Our GRPO step against TRL's `GRPOTrainer` on the reference workload, side by side in one process
(docs/architecture.md §9).

    python bench/compare_trl.py [--json] [--steps 20] [--warmup 3] [--block 1]

Both sides: the cached tiny model (same directory, same weights and tokenizer), the same arithmetic train
prompts in the same order (8 per step, taken from our data module's loader), 8 completions per prompt, ≤ 24
new tokens, temperature 1.0, top-p 1, no top-k, one AdamW update per step (constant lr, gradient clip 1.0),
PPO clip 0.2, no KL (β = 0, no reference model), seq-mean-token-mean loss (TRL's `loss_type="grpo"`),
std-scaled advantages, fp32, CPU, 2 threads, our run's reward (TRL calls it as a plain reward function).
TRL generates with `transformers.generate` (no vLLM) from prompts tokenized by the same tokenizer, which adds
no special tokens (checked at start-up).

The two trainers run in two processes that take turns (`--block` steps each, never at once; see
`common.Baton` for why not threads). TRL's step is timed
from `on_step_begin` to `on_step_end` (generation, reward, loss, backward, clip, optimizer step), ours from
Lightning's batch start to batch end. Budget: `ratio` = ours / TRL ≤ 0.5 (the long workload: ≤ 0.45).

The learning rate is 1e-12 by default (`--lr`): with grpo.yaml's lr (2e-3, `--lr config`) the two policies drift
apart within a few steps (TRL's completions grew from ~3 to ~11 tokens while ours shrank, measured), so the
step times would compare different workloads. At 1e-12 (our module refuses lr 0) every step still runs the full
AdamW update, while the weights move by less than float32 resolves, so the length distributions stay equal;
`ours_response_len_mean` and `trl_response_len_mean`
(tokens per completion, EOS included) show it, and `ratio_work` states both sides' tokens and model FLOPs per step
(bench/README.md "Equal work"; TRL's prefill per row makes its FLOPs differ by design).

`--workload medium` (bench/medium.py: a 159M-parameter Qwen3 of random weights, 128-token prompts, completions of
exactly 256 tokens) micro-batches both updates by 8 rows (TRL: gradient accumulation over 8 micro-batches, its
generation still one batch of 64) and adds the step's roofline: `ours_of_roofline` = the least time this machine
allows for the step's work / our step time (`ours_gen_of_roofline`, `ours_update_of_roofline` per phase), and
`trl_of_roofline` = the same bound / TRL's step time.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

# our GRPO step / TRL's, per workload (docs/results/compare_trl.md; medium: issue 62)
BUDGETS = {"tiny": 0.5, "long": 0.45, "medium": 0.6}


class TRLUnavailable(RuntimeError):
    """TRL cannot run this workload; the message says why."""


class TRLReward:
    """Our run's reward (cfg.reward: arithmetic, or arithmetic_cot on the long workload) as a TRL reward function
    (TRL passes dataset columns as keyword lists); it also records each call's mean completion length in tokens
    (EOS included, as in ours), to compare workloads."""

    def __init__(self, name: str, options: dict):
        from lit_rlvr.rewards import resolve_reward

        self.__name__ = f"{name}_reward"
        self.reward = resolve_reward(name, options)
        self.mean_lengths: list[float] = []
        self.batches: list[tuple[list[str], list[int]]] = []  # per call: prompts, completion lengths (FLOPs)

    def __call__(self, prompts, completions, answer, completion_ids=None, **_unused) -> list[float]:
        if completion_ids is not None:
            self.mean_lengths.append(sum(len(ids) for ids in completion_ids) / max(len(completion_ids), 1))
            self.batches.append((list(prompts), [len(ids) for ids in completion_ids]))
        return [self.reward(p, c, a).score for p, c, a in zip(prompts, completions, answer)]


def step_prompts(cfg, steps: int) -> list[dict]:
    """The first `steps` batches of our training loader, flattened: TRL reads them in order (no shuffle)."""
    from hydra.utils import instantiate

    datamodule = instantiate(cfg.data)
    datamodule.setup("fit")
    rows = []
    for batch, _ in zip(datamodule.train_dataloader(), range(steps)):
        rows += [{"prompt": p, "answer": int(a)} for p, a in zip(batch["prompt"], batch["answer"])]
    return rows


def trl_config(algo, batch_size: int, seed: int, steps: int, output_dir: str):
    """GRPOConfig of the reference workload from our module's `AlgorithmConfig` `algo` (the values in effect);
    fails naming any argument this TRL version lacks."""
    try:
        from trl import GRPOConfig
    except ImportError as err:
        raise TRLUnavailable(f"trl is not installed ({err}); pip install -e '.[bench]'") from err
    rows = batch_size * algo.group_size
    micro = min(algo.micro_batch_size, rows)  # TRL's forward/backward split as ours (`micro_batch_size` rows)
    if rows % micro:
        raise TRLUnavailable(f"algorithm.micro_batch_size={micro} does not divide the step's {rows} rows: TRL "
                             f"accumulates gradients over equal micro-batches")
    wanted = dict(
        output_dir=output_dir, use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False, seed=seed,
        per_device_train_batch_size=micro, gradient_accumulation_steps=rows // micro,
        num_generations=algo.group_size, num_iterations=1, max_completion_length=algo.max_new_tokens,
        temperature=algo.temperature, top_p=algo.top_p, top_k=algo.top_k, beta=0.0, epsilon=algo.eps_low,
        epsilon_high=algo.eps_high, loss_type="grpo", scale_rewards="group" if algo.scale_adv_by_std else "none",
        learning_rate=algo.lr, lr_scheduler_type="constant", optim="adamw_torch", weight_decay=algo.weight_decay,
        adam_beta1=algo.betas[0], adam_beta2=algo.betas[1], max_grad_norm=algo.grad_clip, max_steps=steps,
        shuffle_dataset=False, use_vllm=False, log_completions=False, report_to="none", logging_strategy="no",
        save_strategy="no", eval_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        remove_unused_columns=False,
        # our ignore_eos (length-controlled benchmarks): every completion runs to max_new_tokens
        generation_kwargs={"min_new_tokens": algo.max_new_tokens} if algo.ignore_eos else None,
    )
    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    missing = sorted(set(wanted) - fields)
    if missing:
        raise TRLUnavailable(f"this TRL's GRPOConfig has no argument(s) {missing}; the workload cannot be set up")
    try:
        return GRPOConfig(**wanted)
    except (ValueError, TypeError) as err:
        raise TRLUnavailable(f"GRPOConfig rejects the workload: {err}") from err


def build_trl(cfg, algo, steps: int, rows: list[dict], baton, output_dir: str):
    """(GRPOTrainer, its step timer) on the tiny model directory of `cfg`."""
    from datasets import Dataset
    from omegaconf import OmegaConf
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOTrainer

    from lit_rlvr.models import load_policy

    path = common.model_path(cfg)
    model, tokenizer = load_policy(path, cfg.model.dtype)
    probe = rows[0]["prompt"]
    if tokenizer(text=[probe])["input_ids"][0] != tokenizer(probe, add_special_tokens=False)["input_ids"]:
        raise TRLUnavailable("the tokenizer adds special tokens to plain prompts: TRL's prompts would differ from ours")

    class StepTimer(TrainerCallback):
        """Step walls, and per step the time in TRL's `_generate` (transformers' `generate` of the batch)."""

        def __init__(self):
            self.walls: list[float] = []
            self.gens: list[float] = []
            self._t0 = 0.0

        def add_generate(self, seconds: float) -> None:
            self.gens[-1] += seconds

        def on_train_begin(self, args, state, control, **kwargs):
            baton.acquire("trl", count=False)

        def on_step_begin(self, args, state, control, **kwargs):
            baton.acquire("trl")
            self.gens.append(0.0)
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.walls.append(time.perf_counter() - self._t0)

        def on_train_end(self, args, state, control, **kwargs):
            baton.finish("trl")

    timer = StepTimer()
    reward = TRLReward(cfg.reward.name, OmegaConf.to_container(cfg.reward.options, resolve=True))
    config = trl_config(algo, cfg.data.batch_size, cfg.seed, steps, output_dir)
    try:
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=Dataset.from_list(rows),
                              processing_class=tokenizer, callbacks=[timer])
    except Exception as err:  # any refusal of TRL's is the answer this script must give
        raise TRLUnavailable(f"GRPOTrainer cannot be built: {type(err).__name__}: {err}") from err
    trainer.remove_callback(PrinterCallback)  # its end-of-training dict would land on stdout
    trainer._generate = common.timed(trainer._generate, timer.add_generate)
    return trainer, timer, reward


def trl_flops(model, tokenizer, batches: list[tuple[list[str], list[int]]]) -> list[tuple[float, float]]:
    """(generation, update) model FLOPs of each TRL step from its prompts and completion lengths (EOS included),
    counted as `lit_rlvr.run.perf` counts ours, with what TRL's step runs: transformers' `generate` prefills every
    row (no prompt sharing); the loss runs one forward + backward (num_iterations = 1, β = 0: no old or reference
    log-probs)."""
    import torch

    from lit_rlvr import functional as F
    from lit_rlvr.run.perf import transformer_shape

    shape = transformer_shape(model.config)
    out = []
    for prompts, lengths in batches:
        prompt = torch.tensor([len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts])  # [N]
        response = torch.tensor(lengths)  # [N]
        gen, _ = F.generation_flops(prompt, prompt, response, **shape)
        update, _ = F.update_flops(prompt, response, **shape)
        out.append((float(gen), float(update)))
    return out


def run_ours(overrides: list[str], total: int, baton) -> dict:
    """Our side (a child process of `common.run_in_turns`): per-step rows, the lr in effect, peak RSS."""
    from lit_rlvr.rollout.hf import HFEngine

    cfg = common.compose("grpo", overrides)
    recorder = common.StepRecorder("ours", baton)
    recorder.time_calls(HFEngine, "_forward", "gen_forward_s")  # the transformers forwards inside generation
    module, datamodule, trainer = common.build_run(cfg, total, recorder)
    trainer.fit(module, datamodule=datamodule)
    return {"rows": recorder.rows, "lr": module.algorithm.lr, "peak_rss_mb": common.peak_rss_mb(),
            "peak_flops": module.flops.peak, "peak_bandwidth": module.flops.bandwidth}


def run_trl(overrides: list[str], total: int, baton) -> dict:
    """TRL's side (a child process): step walls, completion lengths, TRL's version, peak RSS."""
    from lit_rlvr.app.recipe import build_module

    cfg = common.compose("grpo", overrides)
    algo = build_module(cfg).algorithm  # the settings our side runs with, as the module resolves them
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as output_dir:
        trainer, timer, reward = build_trl(cfg, algo, total, step_prompts(cfg, total), baton, output_dir)
        trainer.train()
    return {"walls": timer.walls, "gens": timer.gens, "lengths": reward.mean_lengths,
            "tokens": [sum(lengths) for _, lengths in reward.batches],
            "flops": trl_flops(trainer.model, trainer.processing_class, reward.batches),
            "version": __import__("trl").__version__, "peak_rss_mb": common.peak_rss_mb()}


def run(args) -> dict:
    overrides = [*([] if args.lr == "config" else [f"algorithm.lr={float(args.lr)}"]), *args.override]
    total = args.warmup + args.steps
    baton = common.Baton(["ours", "trl"], args.block)
    sides, errors = common.run_in_turns({"ours": (run_ours, (overrides, total)), "trl": (run_trl, (overrides, total))},
                                        baton, args.threads)
    if "trl" in errors:
        raise TRLUnavailable(f"TRL's GRPOTrainer failed on this workload: {errors['trl']}")
    if "ours" in errors:
        raise RuntimeError(f"our GRPO run failed: {errors['ours']}")
    ours, trl = sides["ours"], sides["trl"]
    rows, walls = ours["rows"], trl["walls"]
    if len(walls) < total or len(rows) < total:
        raise RuntimeError(f"steps recorded: ours {len(rows)}, TRL {len(walls)}; expected {total} each")
    ours_summary = common.summarise_rows(rows, args.warmup)
    trl_walls = walls[args.warmup :]
    paired = [o["wall_s"] / t for o, t in zip(rows[args.warmup :], trl_walls)]
    ours_s, trl_s = ours_summary["median_step_s"], common.median(trl_walls)
    return {**run_result(args, ours, trl, ours_summary, paired, ours_s, trl_s),
            **mfu_result(args, ours, trl, ours_summary, trl_s), **roofline_result(args, ours, ours_summary, trl_s),
            "ratio_work": work(args, rows, trl)}


def roofline_result(args, ours: dict, summary: dict, trl_s: float) -> dict:
    """The medium workload's step against its roofline (bench/medium.py, lit_rlvr.functional.roofline): the least
    time this machine's peak and bandwidth allow for the step's work (one prefill per prompt, the decode step by
    step, the update compute-bound), as a share of each side's time: `ours_of_roofline` (and per phase) and
    `trl_of_roofline` (TRL's step against the same work's bound). Other workloads' lengths are sampled: none."""
    if args.workload != "medium" or not ours["peak_flops"] or not ours["peak_bandwidth"]:
        return {}
    bound = common.medium.workload_roofline(args.medium_shape, peak_flops=ours["peak_flops"],
                                            peak_bandwidth=ours["peak_bandwidth"])
    gen_bound = bound["prefill_bound_s"] + bound["decode_bound_s"]
    step_bound = gen_bound + bound["update_bound_s"]
    return {"roofline_s": step_bound, "ours_of_roofline": step_bound / summary["median_step_s"],
            "ours_gen_of_roofline": gen_bound / summary["gen_s"],
            "ours_update_of_roofline": bound["update_bound_s"] / summary["train_s"],
            "trl_of_roofline": step_bound / trl_s, "peak_bandwidth": ours["peak_bandwidth"],
            **{k: bound[k] for k in ("prefill_bound_s", "decode_bound_s", "update_bound_s")},
            **common.medium.machine(args.medium_shape)}


# TRL's side cannot do our step's work exactly: it samples other tokens (its own generator), and its generation
# prefills every row where ours prefills each prompt once
TRL_BY_DESIGN = ("TRL prefills every row (ours: each prompt once) and samples its own tokens; "
                 "algorithm.ignore_eos=true fixes both sides' lengths")


def trl_work(trl: dict, warmup: int) -> dict[str, float]:
    """TRL's generated tokens and model FLOPs per timed step (`run_trl`'s result)."""
    flops = trl["flops"][warmup:]
    return {"tokens": common.mean(trl["tokens"][warmup:]), "gen_flops": common.mean(f[0] for f in flops),
            "update_flops": common.mean(f[1] for f in flops)}


def work(args, rows: list[dict], trl: dict) -> dict:
    """`ratio`'s equal-work entry: each side's generated tokens and model FLOPs per timed step."""
    return common.equal_work({"ours": common.work_per_step(rows, args.warmup), "trl": trl_work(trl, args.warmup)},
                             by_design=TRL_BY_DESIGN)


def mfu_result(args, ours: dict, trl: dict, summary: dict, trl_s: float) -> dict:
    """Each side's model FLOPs utilisation (docs/mfu.md) against the same peak, and where the ratio would be if our
    step ran at the peak (`ratio_at_peak`) or at the MFU budgets (`ratio_at_budget_mfu`): how low `ratio` can go by
    running closer to the hardware's limit, with the FLOPs our step does."""
    peak = ours["peak_flops"]
    if "mfu_update" not in summary or not peak:
        return {}
    gens, walls = trl["gens"][args.warmup :], trl["walls"][args.warmup :]
    flops = trl["flops"][args.warmup :]
    ours_flops = summary["gen_flops"] + summary["update_flops"]
    return {
        "peak_flops": peak,
        "ours_mfu_gen": summary["mfu_gen"], "ours_mfu_update": summary["mfu_update"],
        "trl_mfu_gen": common.median(f[0] / g for f, g in zip(flops, gens)) / peak,
        # TRL's rest of the step: reward, loss forward/backward, clip, AdamW (ours: the update alone)
        "trl_mfu_update": common.median(f[1] / (w - g) for f, w, g in zip(flops, walls, gens)) / peak,
        "ours_gen_flops": summary["gen_flops"], "ours_update_flops": summary["update_flops"],
        "trl_gen_flops": common.median(f[0] for f in flops), "trl_update_flops": common.median(f[1] for f in flops),
        "ratio_at_peak": ours_flops / peak / trl_s,
        "ratio_at_budget_mfu": (summary["gen_flops"] / common.MFU_BUDGETS["mfu_gen"]
                                + summary["update_flops"] / common.MFU_BUDGETS["mfu_update"]) / peak / trl_s,
    }


def run_result(args, ours: dict, trl: dict, ours_summary: dict, paired: list[float], ours_s: float,
               trl_s: float) -> dict:
    """The step times, their ratio and split."""
    trl_walls = trl["walls"][args.warmup :]
    return {
        "ours_median_step_s": ours_s,
        "trl_median_step_s": trl_s,
        "ratio": ours_s / trl_s,
        "ratio_paired": common.median(paired),  # median of step-by-step ratios: robust to load swings
        "budget": BUDGETS[args.workload],
        "steps": args.steps,
        "warmup": args.warmup,
        "lr": ours["lr"],
        "block": args.block,
        "ours_gen_s": ours_summary["gen_s"],
        "ours_train_s": ours_summary["train_s"],
        "trl_gen_s": common.median(trl["gens"][args.warmup :]),
        "trl_rest_s": common.median([w - g for w, g in zip(trl_walls, trl["gens"][args.warmup :])]),
        # our update alone (the same HF forward/backward and AdamW that TRL runs) as a share of TRL's step: the
        # ratio cannot go below it, however fast our generation gets
        "train_floor": ours_summary["train_s"] / trl_s,
        "ours_gen_forward_s": ours_summary["gen_forward_s"],
        # ... nor below this while transformers' model code runs the forwards: all else in the step free
        "model_code_floor": (ours_summary["train_s"] + ours_summary["gen_forward_s"]) / trl_s,
        "ours_response_len_mean": ours_summary["response_len_mean"],
        # the length spread and what our micro-batches computed on padding (the long workload's JSON carries them)
        **{f"ours_{k}": ours_summary[k] for k in ("response_len_max", "padding_frac") if k in ours_summary},
        "trl_response_len_mean": common.median(trl["lengths"][args.warmup :]),
        "peak_rss_mb": max(ours["peak_rss_mb"], trl["peak_rss_mb"]),
        **common.context(),
        "trl_version": trl["version"],
    }


DEFAULT_LR = "1e-12"  # module docstring: both policies keep their weights, every update still runs in full


def main(argv=None) -> None:
    parser = common.bench_parser(__doc__.split("\n\n")[0], steps_help="timed RL steps per side",
                                 warmup_help="untimed RL steps per side first", block_help="steps per turn",
                                 override_help="extra Hydra override for our side")
    parser.add_argument("--lr", default=DEFAULT_LR, help="learning rate of both sides, or 'config' for grpo.yaml's; "
                        "1e-12 (default) keeps both policies at their weights, so both generate the same length "
                        "distribution while every update still runs in full")
    args = common.parse_bench_args(parser, argv)
    try:
        result = run(args)
    except TRLUnavailable as err:
        print(f"compare_trl: TRL cannot run this workload: {err}", file=sys.stderr)
        common.emit({"error": str(err)}, args.json)
        raise SystemExit(2) from err
    common.report(result, args, "compare_trl.py")


if __name__ == "__main__":
    main()
