"""The pinned settings of `scripts/reproduce.py`, per task: a later change of a config default must not change a
committed comparison, so every setting it depends on is an explicit override here.

A task (`--task`) holds the warm-up, data and loop settings, the scale (steps, prompts, evaluation) and C3PO's IVON
learning rate; the methods and the claims are shared, and each task names the methods it runs by default. How the
chain-of-thought task's values were chosen (levels, steps, IVON lr): `docs/results/reproduction_cot.md`, "Pilots".
"""

from __future__ import annotations

from dataclasses import dataclass, field

# -- shared by both tasks ---------------------------------------------------------------------------------------------
SAMPLING = ["algorithm.temperature=1.0", "algorithm.top_p=1.0", "algorithm.top_k=0", "algorithm.eval_temperature=1.0",
            "algorithm.kl_coef=0.0", "algorithm.entropy_coef=0.0", "algorithm.ppo_epochs=1", "algorithm.mini_batches=1",
            "algorithm.eps_low=0.2", "algorithm.eps_high=0.2", "algorithm.loss_aggregation=seq-mean-token-mean",
            "algorithm.micro_batch_size=64", "algorithm.warmup_steps=0"]
RUN = ["engine=hf", "engine.options.mode=shared", "trainer=cpu", "logger=csv", "callbacks.progress=null",
       "eval_before=true"]
VP = "algorithm.callbacks.value_prior"
V05 = [f"{VP}.k_init=4", f"{VP}.k_max=16", f"{VP}.cost=0.0039", f"{VP}.min_active_frac=0.25", f"{VP}.pad_to=32",
       f"{VP}.round_size=1", f"{VP}.context_size=256", f"{VP}.min_context=32",
       f"{VP}.backbone=minilm", f"{VP}.head=kernel", f"{VP}.features=auto", f"{VP}.max_length=128"]
LORA8 = ["model.lora.rank=8", "model.lora.alpha=32", "model.lora.target_modules=all-linear", "model.lora.dropout=0.0"]
GRPO_LORA_LR_SCALE = 10.0  # GRPO's adapters: lr = 10 x the full-weight lr (the library's default rule, docs/lora.md)


def adamw(lr: float) -> list[str]:
    return ["++algorithm.optimizer=adamw", f"algorithm.lr={lr}", "algorithm.weight_decay=0.0",
            "algorithm.grad_clip=1.0"]


def ivon(lr: float, ess: float = 1e8, num_samples: int = 4, generate: str = "samples") -> list[str]:
    """C3PO's IVON settings: the tiny preset of conf/algorithm/c3po.yaml with the task's learning rate; the 3PO
    study varies λ (`ess`), N and who generates (`generate=mean`: IVON without exploration)."""
    return ["algorithm.optimizer=ivon", f"algorithm.lr={lr}", "algorithm.grad_clip=0.0", "algorithm.weight_decay=0.0",
            f"algorithm.optimizer_options.ess={float(ess)}", "algorithm.optimizer_options.hess_init=0.001",
            "algorithm.optimizer_options.weight_decay=0.000001", "algorithm.optimizer_options.beta1=0.9",
            "algorithm.optimizer_options.beta2=0.9999", "algorithm.optimizer_options.clip_radius=1.0",
            "algorithm.optimizer_options.hess_approx=price", "algorithm.optimizer_options.rescale_lr=true",
            "algorithm.callbacks.param_noise.variant=c3po",
            f"algorithm.callbacks.param_noise.num_samples={num_samples}",
            "algorithm.seq_mask_tau=2.0", *([f"algorithm.callbacks.param_noise.generate={generate}"]
                                            if generate != "samples" else [])]


@dataclass(frozen=True)
class Task:
    name: str
    title: str  # the doc's and the figure's title
    doc: str  # default --doc
    model: list[str]  # the warmed-up policy
    data: list[str]
    loop: list[str]  # completion budget, micro-batching, checkpoints
    grpo_lr: float
    ivon_lr: float  # C3PO's step size on this task
    c3po_lora_lr_scale: float  # C3PO on adapters: their IVON lr = ivon_lr x this (model.lora.lr_scale)
    methods: list[str]  # run by default
    scale: dict = field(default_factory=dict)  # defaults of the scale flags (steps, batch_size, ...)
    setup: str = ""  # the doc's sentence on what is specific to this task


ARITHMETIC = Task(
    name="arithmetic", title="the built-in 3-token arithmetic task", doc="docs/results/reproduction.md",
    model=["model=tiny", "model.dtype=float32", "model.options.target=0.3", "model.options.max_steps=2000",
           "model.options.eval_every=25", "model.options.eval_problems=256", "model.options.eval_samples=4",
           "model.options.batch_size=64", "model.options.lr=0.001", "model.options.warmup_steps=80",
           "model.options.seed=0", "++model.options.levels=[2,3,4]"],  # warm-up: stops at held-out mean@4 0.3
    data=["data=arithmetic", "reward=arithmetic", "data.levels=[2,3,4]", "data.split_seed=0", "data.num_train=100000",
          "data.eval_batch_size=128"],
    loop=["algorithm.max_new_tokens=8", "checkpoint_every=1000000"],
    grpo_lr=3e-4, ivon_lr=0.03, c3po_lora_lr_scale=10.0,
    methods=["grpo_g16", "grpo_g4", "v05", "c3po", "c3po_v05"],
    scale=dict(steps=150, batch_size=32, num_test=512, eval_samples=8, eval_every=25, oracle_every=10,
               oracle_samples=32),
    setup="answers of at most 8 tokens (the model writes the number only); levels 2-4 (2- and 3-digit sums and "
          "differences)",
)

COT_LEVELS = "[1,2,3,4,5,6]"
ARITHMETIC_COT = Task(
    name="arithmetic_cot", title="the built-in chain-of-thought arithmetic task",
    doc="docs/results/reproduction_cot.md",
    model=["model=tiny_cot", "model.dtype=float32", "model.options.target=0.3", "model.options.max_steps=3000",
           "model.options.eval_every=50", "model.options.eval_problems=256", "model.options.eval_samples=4",
           "model.options.batch_size=32", "model.options.lr=0.002", "model.options.warmup_steps=50",
           "model.options.seed=0", "model.options.hidden_size=128", "model.options.layers=4",
           "model.options.task=arithmetic_cot", "model.options.max_new_tokens=64",
           f"++model.options.levels={COT_LEVELS}"],
    data=["data=arithmetic_cot", "reward=arithmetic_cot", f"data.levels={COT_LEVELS}", "data.split_seed=0",
          "data.num_train=100000", "data.eval_batch_size=128"],
    loop=["algorithm.max_new_tokens=64", "algorithm.micro_batch_tokens=2048", "checkpoint_every=10"],
    grpo_lr=3e-4, ivon_lr=0.3, c3po_lora_lr_scale=1.0,  # from the pilots (the doc's "Pilots")
    methods=["grpo_g16", "grpo_g4", "v05", "c3po", "c3po_v05", "grpo_g16_lora8", "c3po_lora8"],
    scale=dict(steps=50, batch_size=32, num_test=256, eval_samples=4, eval_every=10, oracle_every=10,
               oracle_samples=16),
    setup="completions that write their working (30-60 tokens, at most 64 new tokens); levels 1-6 (2-4-digit "
          "sums, 3-4-digit differences, 2-digit by 1-digit products)",
)
TASKS = {t.name: t for t in (ARITHMETIC, ARITHMETIC_COT)}

# -- the 3PO study (docs/results/reproduction_3po.md): λ, exploration against the optimizer, N ---------------------
# λ (IVON's ess) -> the IVON lr it runs at on the chain-of-thought task: the largest of the pilots' {0.3, 1.0} whose
# held-out accuracy did not fall (lr 1.0 fell by step 10 at every λ from 1e7 to 1e10); λ <= 1e6 collapses at any lr
# (every loss token masked by τ: the run stops), so the sweep starts at 1e7 (reproduction_3po.md, "Pilots")
ESS_LR = {1e7: 0.3, 1e8: 0.3, 1e9: 0.3, 1e10: 0.3}
# AdamW's lr whose relative weight change after 50 steps matches C3PO's (0.0066): lr 5.4e-5 moved the weights 0.0119
# in the pilot, and Adam's step scales with its lr
MATCHED_ADAMW_LR = 3.0e-5
PROBE = "callbacks.dead_groups"
PROBE_OVERRIDES = [f"+{PROBE}._target_=lit_rlvr.callbacks.dead_groups.DeadGroupProbe", f"+{PROBE}.every_n_steps=10",
                   f"+{PROBE}.hot_temperature=1.5"]


def ess_key(ess: float) -> str:
    return f"c3po_ess{ess:.0e}".replace("e+0", "e").replace("e+", "e")


def ess_of_methods() -> dict[str, float]:
    """The λ sweep's methods and their λ (C3PO's preset row is the sweep's λ = 1e8 point)."""
    return {"c3po": 1e8, **{ess_key(e): e for e in ESS_LR if e != 1e8}}


STUDY_3PO = ["grpo_g16", "c3po", "ivon_mean", "grpo_g16_matched", *[ess_key(e) for e in ESS_LR if e != 1e8],
             "c3po_n1", "c3po_n2", "c3po_n8"]
PROBED = {"c3po", "ivon_mean"}  # the dead-group probe (callbacks/dead_groups.py) runs on these

# -- the rivals study (docs/results/rivals.md): V0.5 and 3PO against their cheapest rivals ----------------------------
# The history-based methods (DBB, the boundary gate, Beta allocation) need prompts that come back: the study trains on
# a fixed set of RIVALS_TRAIN prompts (50 steps of 32 = 5 passes over 320), the same for every method
RIVALS_TRAIN = 320
RIVALS_MEAN_ROLLOUTS = 9  # uniform and Beta allocation: OSLA spent 9.1 per prompt on this task (reproduction_cot.md)
RIVALS_ESS = 1e10  # C3PO's tuned λ: the best held-out mean@4 and pass@4 of the 3PO study's sweep (reproduction_3po.md)
DBB_GROUP = 8  # DBB at G = 8: 256 rollouts a step, near V0.5's ~290, so "at equal rollouts" reads close to both ends
STUDY_RIVALS = ["grpo_g16", "v05", "dbb", "v05_uniform", "v05_beta", "c3po_tuned", "grpo_g16_gate", "c3po_tuned_gate"]
# pass@k up to 16 from 16 held-out samples; no oracle; 4096 held-out rollouts per evaluation, so every 25 steps (3
# points a curve) keeps the evaluations below the training's own rollouts and 24 runs within ~90 min on 2 cores
RIVALS_SCALE = dict(eval_samples=16, oracle_every=0, eval_every=25)

# key -> label; the group sizes, k and N are the issue's
LABELS = {
    "grpo_g16": "GRPO (G = 16)",
    "grpo_g4": "GRPO (G = 4)",
    "v05": "V0.5 (k_init = 4, OSLA ≤ 16)",
    "c3po": "C3PO (N = 4, G = 16)",
    "c3po_v05": "C3PO + V0.5 (N = 4, k_init = 4, OSLA ≤ 16)",
    "grpo_g16_lora8": "GRPO (G = 16), LoRA r = 8",
    "c3po_lora8": "C3PO (N = 4, G = 16), LoRA r = 8",
    "grpo_g16_async1": "GRPO (G = 16), async S = 1",
    "grpo_g16_async4": "GRPO (G = 16), async S = 4",
    "ivon_mean": "IVON, the mean generates (C3PO's update, no exploration)",
    "grpo_g16_matched": "GRPO (G = 16), AdamW at C3PO's step size",
    **{ess_key(e): f"C3PO, λ = {e:.0e}" for e in ESS_LR if e != 1e8},
    **{f"c3po_n{n}": f"C3PO (N = {n}, G = 16)" for n in (1, 2, 8)},
    "dbb": f"DBB (G = {DBB_GROUP}, γ = 0.9, Beta(1, 1))",
    "v05_uniform": f"V0.5, uniform allocation ({RIVALS_MEAN_ROLLOUTS} per prompt)",
    "v05_beta": f"V0.5, Beta-posterior allocation ({RIVALS_MEAN_ROLLOUTS} per prompt)",
    "c3po_tuned": f"C3PO (N = 4, G = 16, λ = {RIVALS_ESS:.0e})",
    "grpo_g16_gate": "GRPO (G = 16) + boundary gating",
    "c3po_tuned_gate": f"C3PO (λ = {RIVALS_ESS:.0e}) + boundary gating",
}


def method_overrides(method: str, task: Task) -> list[str]:
    """The overrides that make `method` on `task` (after the task's own)."""
    grpo, c3po = adamw(task.grpo_lr), ivon(task.ivon_lr)
    return {
        "grpo_g16": ["algorithm=grpo", "algorithm.group_size=16", "algorithm.scale_adv_by_std=true", *grpo],
        "grpo_g4": ["algorithm=grpo", "algorithm.group_size=4", "algorithm.scale_adv_by_std=true", *grpo],
        "v05": ["algorithm=v05", "algorithm.scale_adv_by_std=false", *grpo, *V05],
        "c3po": ["algorithm=c3po", "algorithm.group_size=16", "algorithm.scale_adv_by_std=true", *c3po],
        "c3po_v05": ["algorithm=c3po_v05", "algorithm.scale_adv_by_std=false", *c3po, *V05],
        "grpo_g16_lora8": ["algorithm=grpo", "algorithm.group_size=16", "algorithm.scale_adv_by_std=true", *grpo,
                           *LORA8, f"model.lora.lr_scale={GRPO_LORA_LR_SCALE}"],
        "c3po_lora8": ["algorithm=c3po", "algorithm.group_size=16", "algorithm.scale_adv_by_std=true", *c3po,
                       *LORA8, f"model.lora.lr_scale={task.c3po_lora_lr_scale}"],
        "ivon_mean": ["algorithm=c3po", "algorithm.group_size=16", "algorithm.scale_adv_by_std=true",
                      *ivon(task.ivon_lr, generate="mean")],
        "grpo_g16_matched": ["algorithm=grpo", "algorithm.group_size=16", "algorithm.scale_adv_by_std=true",
                             *adamw(MATCHED_ADAMW_LR)],
        **{ess_key(e): ["algorithm=c3po", "algorithm.group_size=16", "algorithm.scale_adv_by_std=true",
                        *ivon(lr, ess=e)] for e, lr in ESS_LR.items() if e != 1e8},
        **{f"c3po_n{n}": ["algorithm=c3po", "algorithm.group_size=16", "algorithm.scale_adv_by_std=true",
                          *ivon(task.ivon_lr, num_samples=n)] for n in (1, 2, 8)},
        "dbb": ["algorithm=grpo", f"algorithm.group_size={DBB_GROUP}", "algorithm.scale_adv_by_std=true",
                "algorithm.advantages=dbb", "algorithm.dbb_discount=0.9", "algorithm.dbb_prior_alpha=1.0",
                "algorithm.dbb_prior_beta=1.0", *grpo],
        **{f"v05_{rule}": ["algorithm=v05", "algorithm.scale_adv_by_std=false", *grpo, *V05,
                           f"{VP}.allocation={rule}", f"{VP}.mean_rollouts={RIVALS_MEAN_ROLLOUTS}"]
           for rule in ("uniform", "beta")},
        "c3po_tuned": ["algorithm=c3po", "algorithm.group_size=16", "algorithm.scale_adv_by_std=true",
                       *ivon(ESS_LR[RIVALS_ESS], ess=RIVALS_ESS)],
        "grpo_g16_gate": ["algorithm=grpo", "algorithm.group_size=16", "algorithm.scale_adv_by_std=true", *grpo,
                          "algorithm.boundary_gating=true"],
        "c3po_tuned_gate": ["algorithm=c3po", "algorithm.group_size=16", "algorithm.scale_adv_by_std=true",
                            *ivon(ESS_LR[RIVALS_ESS], ess=RIVALS_ESS), "algorithm.boundary_gating=true"],
        **{f"grpo_g16_async{s}": ["algorithm=grpo", "algorithm.group_size=16", "algorithm.scale_adv_by_std=true",
                                   *grpo, "rollout.mode=async", f"rollout.max_staleness={s}",
                                   "engine.options.mode=copy"] for s in (1, 4)},  # (RUN pins the shared engine)
    }[method]


def is_async(method: str) -> bool:
    """Asynchronous rollouts: the oracle baseline (drawn with the step's own weights) does not run with them."""
    return "async" in method


# the table's figures per run: (key, column header); computed in reproduce.run_figures, defined in the doc
FIGURES = [
    ("acc_after", "held-out mean@k after"),
    ("acc_gain", "held-out gain"),
    ("pass_after", "held-out pass@k after"),
    ("train_acc_tail", "train rollout acc (last 10%)"),
    ("rollouts", "rollouts consumed"),
    ("tokens", "tokens generated"),
    ("grad_mean", "grad-norm mean"),
    ("grad_std", "grad-norm sd (over steps)"),
    ("entropy_tail", "entropy (last 10%)"),
    ("equal_frac", "equal-reward groups"),
    ("zero_adv_frac", "zero-advantage groups"),
    ("malformed_frac", "malformed"),
    ("baseline_mse", "baseline MSE vs oracle"),
    ("len_tail", "completion length (last 10%)"),
    ("clip_tail", "truncated (last 10%)"),
    ("wall_s", "wall s / run"),
]
# the 3PO study's figures per run (a second table, shown when a run has them)
EXPLORATION_FIGURES = [
    ("noise_rel", "noise / weights (RMS)"),
    ("weight_change", "relative weight change"),
    ("dead_frac", "dead groups (probe)"),
    ("rescued_again", "rescued: second draw"),
    ("rescued_weights", "rescued: N weight samples"),
    ("rescued_hot", "rescued: T = 1.5"),
    ("malformed_weights", "malformed: weight samples"),
    ("malformed_hot", "malformed: T = 1.5"),
]
DIGITS = {"noise_rel": 4, "weight_change": 4,
          "rollouts": 0, "tokens": 0, "wall_s": 0, "baseline_mse": 4, "malformed_frac": 4, "clip_tail": 4,
          "len_tail": 1}
# a figure of a pair of runs (method, reference) rather than of one run: see reproduce.paired_figure
EQUAL_ROLLOUTS = "acc_at_equal_rollouts"

# (claim, method, reference, figure, sign): the claim holds when sign·(method − reference) > 0
CLAIMS = [
    ("V0.5 beats GRPO G=16: held-out accuracy", "v05", "grpo_g16", "acc_after", +1),
    ("V0.5 vs GRPO G=16: train rollout accuracy", "v05", "grpo_g16", "train_acc_tail", +1),
    ("V0.5 vs GRPO G=16: fewer rollouts", "v05", "grpo_g16", "rollouts", -1),
    ("V0.5 vs GRPO G=16: fewer tokens generated", "v05", "grpo_g16", "tokens", -1),
    ("V0.5 vs GRPO G=16: lower gradient norm", "v05", "grpo_g16", "grad_mean", -1),
    ("V0.5 vs GRPO G=16: steadier gradient norm (sd)", "v05", "grpo_g16", "grad_std", -1),
    ("V0.5 vs GRPO G=16: higher entropy", "v05", "grpo_g16", "entropy_tail", +1),
    ("V0.5 vs GRPO G=16: lower baseline MSE", "v05", "grpo_g16", "baseline_mse", -1),
    ("V0.5 vs GRPO G=4: lower baseline MSE", "v05", "grpo_g4", "baseline_mse", -1),
    ("V0.5 beats GRPO G=4: held-out accuracy", "v05", "grpo_g4", "acc_after", +1),
    ("V0.5 beats GRPO G=4: held-out accuracy at equal rollouts", "v05", "grpo_g4", EQUAL_ROLLOUTS, +1),
    ("V0.5 beats GRPO G=4: train rollout accuracy", "v05", "grpo_g4", "train_acc_tail", +1),
    ("C3PO beats GRPO G=16: held-out accuracy", "c3po", "grpo_g16", "acc_after", +1),
    ("C3PO beats GRPO G=16: held-out pass@k", "c3po", "grpo_g16", "pass_after", +1),
    ("C3PO beats GRPO G=16: train rollout accuracy", "c3po", "grpo_g16", "train_acc_tail", +1),
    ("C3PO vs GRPO G=16: fewer zero-advantage groups", "c3po", "grpo_g16", "zero_adv_frac", -1),
    ("C3PO vs GRPO G=16: fewer malformed rollouts", "c3po", "grpo_g16", "malformed_frac", -1),
    ("C3PO + V0.5 beats C3PO: held-out accuracy", "c3po_v05", "c3po", "acc_after", +1),
    ("C3PO + V0.5 beats V0.5: held-out accuracy", "c3po_v05", "v05", "acc_after", +1),
    ("C3PO + V0.5 vs C3PO: fewer rollouts", "c3po_v05", "c3po", "rollouts", -1),
    ("LoRA r=8 no worse than full: GRPO G=16, held-out accuracy", "grpo_g16_lora8", "grpo_g16", "acc_after", +1),
    ("LoRA r=8 no worse than full: C3PO, held-out accuracy", "c3po_lora8", "c3po", "acc_after", +1),
    ("async S=1 learns as well as sync per step: held-out accuracy", "grpo_g16_async1", "grpo_g16", "acc_after", +1),
    ("async S=4 learns as well as sync per step: held-out accuracy", "grpo_g16_async4", "grpo_g16", "acc_after", +1),
    # the 3PO study
    ("C3PO beats IVON with the mean generating: held-out accuracy (what weight noise buys)", "c3po", "ivon_mean",
     "acc_after", +1),
    ("C3PO beats IVON with the mean generating: held-out pass@k", "c3po", "ivon_mean", "pass_after", +1),
    ("IVON-mean beats AdamW at the same step size: held-out accuracy (what the optimizer buys)", "ivon_mean",
     "grpo_g16_matched", "acc_after", +1),
    ("C3PO beats AdamW at the same step size: held-out accuracy", "c3po", "grpo_g16_matched", "acc_after", +1),
    ("the paper's shape: λ = 1e8 beats more noise (λ = 1e7): held-out accuracy", "c3po", "c3po_ess1e7",
     "acc_after", +1),
    ("the paper's shape: λ = 1e8 beats less noise (λ = 1e9): held-out accuracy", "c3po", "c3po_ess1e9",
     "acc_after", +1),
    ("the paper's shape: λ = 1e8 beats almost no noise (λ = 1e10): held-out accuracy", "c3po", "c3po_ess1e10",
     "acc_after", +1),
    ("C3PO N=4 beats N=1: held-out accuracy", "c3po", "c3po_n1", "acc_after", +1),
    ("C3PO N=4 beats N=2: held-out accuracy", "c3po", "c3po_n2", "acc_after", +1),
    ("C3PO N=8 beats N=4: held-out accuracy", "c3po_n8", "c3po", "acc_after", +1),
    # the rivals study
    ("V0.5 beats DBB at equal rollouts: held-out accuracy", "v05", "dbb", EQUAL_ROLLOUTS, +1),
    ("V0.5 beats DBB: held-out accuracy after equal steps", "v05", "dbb", "acc_after", +1),
    ("OSLA beats uniform allocation at equal rollouts: held-out accuracy", "v05", "v05_uniform", EQUAL_ROLLOUTS, +1),
    ("OSLA beats Beta-posterior allocation at equal rollouts: held-out accuracy", "v05", "v05_beta", EQUAL_ROLLOUTS,
     +1),
    ("Beta-posterior beats uniform allocation at equal rollouts: held-out accuracy", "v05_beta", "v05_uniform",
     EQUAL_ROLLOUTS, +1),
    ("C3PO beats boundary gating on pass@16", "c3po_tuned", "grpo_g16_gate", "pass_after", +1),
    ("boundary gating beats GRPO G=16 on pass@16", "grpo_g16_gate", "grpo_g16", "pass_after", +1),
    ("C3PO beats GRPO G=16 on pass@16", "c3po_tuned", "grpo_g16", "pass_after", +1),
    ("C3PO + gating beats C3PO on pass@16", "c3po_tuned_gate", "c3po_tuned", "pass_after", +1),
    ("DBB (G=8) beats GRPO G=16 at equal rollouts: held-out accuracy", "dbb", "grpo_g16", EQUAL_ROLLOUTS, +1),
]
