"""Real-data integration: `python train.py data=jsonl ...` on prompt files (arithmetic prompts and code tasks),
`mode=eval` metrics, bad rows, every shipped data/reward/model config composed and instantiated on a small file
in its expected schema, and the data-preparation code of docs/math_and_code.md run on stand-in files.

The four train.py runs start together in the background when this module starts (they are independent but for
the eval run, which needs the training checkpoint), so the in-process tests run while they train.
"""

from __future__ import annotations

import base64
import csv
import json
import os
import pickle
import re
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
DOC = REPO / "docs" / "math_and_code.md"
# data=jsonl's 1024-token budget does not fit the tiny model's 256 positions: its arithmetic answers need 8
SMALL = ["model=tiny", "eval_before=false", "data.batch_size=4", "algorithm.group_size=4", "data.eval_limit=8",
         "callbacks.progress=null", "algorithm.max_new_tokens=8"]
BOXED = "Please reason step by step, and put your final answer within \\boxed{}."


# ------------------------------------------------------------------------------------------------------
# Files and background runs


def _write(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _arithmetic_rows(n: int) -> list[dict]:
    from lit_rlvr.data.tasks.arithmetic import ArithmeticTask

    task = ArithmeticTask(levels=(1, 2), seed=0)
    problems = [task.problem(i, "train") for i in range(n)]
    return [{"prompt": p["prompt"], "answer": str(p["answer"])} for p in problems]


def _code_rows(n: int) -> list[dict]:
    stdin = {"inputs": ["1 2\n", "5 7\n"], "outputs": ["3\n", "12\n"]}
    call = {"inputs": [[1], [4]], "outputs": [2, 8], "fn_name": "double"}
    tasks = [("Read two integers from stdin and print their sum.", stdin),
             ("Write a function double(x) that returns 2 * x.", call)]
    return [{"prompt": tasks[i % 2][0], "tests": json.dumps(tasks[i % 2][1])} for i in range(n)]


class _Run:
    """One `python train.py ...` in the background; `result()` waits and returns (rc, stdout, stderr)."""

    def __init__(self, name: str, overrides: list[str], logs: Path):
        self.out, self.err = logs / f"{name}.out", logs / f"{name}.err"
        with self.out.open("w") as out, self.err.open("w") as err:
            self.proc = subprocess.Popen([sys.executable, "train.py", *overrides], cwd=REPO, stdout=out, stderr=err,
                                         env={**os.environ, "HF_HUB_OFFLINE": "1"})

    def result(self) -> tuple[int, str, str]:
        rc = self.proc.wait(timeout=600)
        return rc, self.out.read_text(), self.err.read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module", autouse=True)
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("integration")
    rows = _arithmetic_rows(24)
    bad = rows[:4] + [{"prompt": rows[4]["prompt"]}] + rows[5:]  # row 5 has no answer
    files = {"ok": _write(root / "ok.jsonl", rows), "bad": _write(root / "bad.jsonl", bad),
             "code": _write(root / "code.jsonl", _code_rows(8))}
    dirs = {name: root / name for name in ("train", "bad_row", "code", "eval")}
    started = {
        "train": _Run("train", ["data=jsonl", f"data.path={files['bad']}", "data.on_bad_row=skip", "reward=arithmetic",
                                "trainer.max_steps=3", f"hydra.run.dir={dirs['train']}", *SMALL], root),
        "bad_row": _Run("bad_row", ["data=jsonl", f"data.path={files['bad']}", "trainer.max_steps=3",
                                    f"hydra.run.dir={dirs['bad_row']}", *SMALL], root),
        "code": _Run("code", ["data=jsonl", f"data.path={files['code']}", "data.fields.answer=tests", "reward=code",
                              "trainer.max_steps=2", f"hydra.run.dir={dirs['code']}", *SMALL], root),
    }
    yield {"root": root, "files": files, "dirs": dirs, "runs": started}
    for run in started.values():
        run.stop()


# ------------------------------------------------------------------------------------------------------
# In-process: prompt decoration, configs, rewards, docs (while the runs above train)


def test_with_instruction_appends_to_last_user_turn_and_adds_system_prompt():
    from lit_rlvr.data.datamodule import with_instruction

    assert with_instruction("2+2?", "Think.") == "2+2?\nThink."
    assert with_instruction("2+2?") == "2+2?"
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q "}]
    assert with_instruction(messages, "Think.", "other") == [{"role": "system", "content": "S"},
                                                               {"role": "user", "content": "Q\nThink."}]
    assert messages[1]["content"] == "Q "  # the record itself is not changed
    assert with_instruction("Q", None, "Sys") == [{"role": "system", "content": "Sys"}, {"role": "user",
                                                                                         "content": "Q"}]


def _compose(*overrides: str):
    from hydra import compose, initialize_config_dir

    import lit_rlvr.config.schemas  # noqa: F401  (registers the groups' typed schemas that conf/config.yaml names)

    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def _verl(prompt: list[dict], answer: str) -> dict:
    return {"data_source": "x", "prompt": prompt, "ability": "MATH", "extra_info": {"index": 0},
            "reward_model": {"style": "rule", "ground_truth": answer}}


_STDIN_TESTS = json.dumps({"inputs": ["2\n"], "outputs": ["4\n"]})
_MATH = [("What is 3+4?", "7"), ("What is 1/2 + 1/4?", "\\frac{3}{4}"), ("How many primes are below 10?", "4")]
# config -> (file name, rows in its expected schema, usual reward, prompt check)
SCHEMAS = {
    "arithmetic": (None, None, "arithmetic", None),
    "arithmetic_cot": (None, None, "arithmetic_cot", None),
    "jsonl": ("f.jsonl", [{"prompt": q, "answer": a} for q, a in _MATH], "arithmetic", "plain"),
    "parquet": ("f.parquet", [{"prompt": q, "answer": a} for q, a in _MATH], "arithmetic", "plain"),
    "dapo_math": ("f.parquet", [_verl([{"role": "user", "content": q + ' Answer: $Answer'}], a) for q, a in _MATH],
                  "math", "messages"),
    "code_r1": ("f.parquet", [_verl([{"role": "system", "content": "Think, then answer."},
                                     {"role": "user", "content": "Double the number on stdin."}], _STDIN_TESTS)] * 2,
                "code", "messages"),
    "livecodebench": ("f.jsonl", [{"prompt": "### Question:\nDouble it.", "tests": _STDIN_TESTS}] * 2, "code",
                      "system"),
    **{name: ("f.jsonl", [{"problem": q, "answer": a} for q, a in _MATH], "math", "boxed")
       for name in ("math_eval", "aime24", "aime25", "math500")},
    **{name: ("f.jsonl", [{"question": q, "answer": a} for q, a in _MATH], "math", "boxed")
       for name in ("amc23", "minerva", "olympiadbench")},
}


def test_every_data_config_has_a_schema_here():
    assert {p.stem for p in (CONF / "data").glob("*.yaml")} == set(SCHEMAS)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_data_config_composes_and_loads_a_file(name, tmp_path):
    from hydra.utils import instantiate

    filename, rows, reward, check = SCHEMAS[name]
    overrides = [f"data={name}"] + ([f"data.path={_write(tmp_path / filename, rows)}"] if rows else [])
    cfg = _compose(*overrides)
    assert cfg.reward.name == reward
    datamodule = instantiate(cfg.data)
    datamodule.setup("fit")
    batch = next(iter(datamodule.val_dataloader()))
    if rows is None:
        return
    assert len(datamodule.train_set) == len(rows) and len(batch["prompt"]) == len(rows)
    prompt, answer = batch["prompt"][0], batch["answer"][0]
    if reward == "code":
        from lit_rlvr.rewards.code import parse_tests

        assert parse_tests(answer) == ([("2\n", "4\n")], None)
    else:
        assert answer == _MATH[0][1]
    if check == "boxed":
        assert prompt == f"{_MATH[0][0]}\n{BOXED}"
    elif check == "plain":
        assert prompt == _MATH[0][0]
    elif check == "messages":
        assert isinstance(prompt, list) and prompt[-1]["role"] == "user"
    elif check == "system":
        assert [m["role"] for m in prompt] == ["system", "user"] and "Python programmer" in prompt[0]["content"]


def test_data_config_picks_reward_but_the_command_line_wins():
    assert _compose("data=dapo_math", "reward=arithmetic").reward.name == "arithmetic"
    assert _compose("reward=code", "data=aime24").reward.name == "code"


def test_eval_fields_map_a_differently_shaped_eval_file(tmp_path):
    from hydra.utils import instantiate

    train = _write(tmp_path / "train.parquet", SCHEMAS["dapo_math"][1])
    evals = _write(tmp_path / "math500.jsonl", [{"problem": q, "answer": a} for q, a in _MATH])
    cfg = _compose("data=dapo_math", f"data.path={train}", f"data.eval_path={evals}",
                   "data.eval_fields={prompt:problem,answer:answer}")
    datamodule = instantiate(cfg.data)
    datamodule.setup("fit")
    assert [datamodule.eval_set[i]["prompt"] for i in range(3)] == [q for q, _ in _MATH]


def test_model_configs_name_their_models_and_set_the_chat_template():
    from lit_rlvr.app.recipe import build_module

    assert _compose("model=qwen3_4b").model.name_or_path == "Qwen/Qwen3-4B-Instruct-2507"
    qmath = _compose("model=qwen25_math_7b").model
    assert (qmath.name_or_path, qmath.chat_template) == ("Qwen/Qwen2.5-Math-7B", True)
    assert _compose("model=qwen3_4b").model.chat_template is True
    assert _compose().model.chat_template is False  # tiny: raw prompts; the model config is the one owner
    assert "chat_template" not in _compose().algorithm
    module = build_module(_compose("model.chat_template=true"))
    assert module.settings.model.chat_template is True
    module.reward_runner.close()


REWARD_CASES = {  # completion, answer -> score, malformed
    "arithmetic": [("4", 4, 1.0, False), ("5", 4, -1.0, False), ("x", 4, -1.0, True)],
    "arithmetic_cot": [("2+2+0=4\nAnswer: 4", 4, 1.0, False), ("Answer: 5", 4, -1.0, False), ("4", 4, -1.0, True)],
    "math": [("So the answer is \\boxed{\\frac{1}{2}}.", "0.5", 1.0, False), ("\\boxed{3}", "4", -1.0, False),
             ("I do not know.", "4", -1.0, True)],
    "code": [("```python\nprint(int(input()) * 2)\n```", _STDIN_TESTS, 1.0, False),
             ("```python\nprint(5)\n```", _STDIN_TESTS, -1.0, False), ("No code here.", _STDIN_TESTS, -1.0, True)],
    # the answer (+-1) plus 0.1 when the completion is one integer alone
    "arithmetic_format": [("4", 4, 1.1, False), ("5", 4, -0.9, False), ("x", 4, -1.0, True)],
}
# configs that need a value of the user's (a URL, a model folder, the terms): built and scored in their own tests
NEEDS_A_VALUE = {"judge", "model", "remote", "terms"}


@pytest.mark.parametrize("name", sorted({p.stem for p in (CONF / "reward").glob("*.yaml")} - NEEDS_A_VALUE))
def test_reward_config_builds_and_scores(name):
    from omegaconf import OmegaConf

    from lit_rlvr.rewards import build_reward_runner

    cfg = _compose(f"reward={name}").reward
    runner = build_reward_runner(cfg.name, OmegaConf.to_container(cfg.options, resolve=True))
    cases = REWARD_CASES[name]
    try:
        batch = runner(["p"] * len(cases), [c[0] for c in cases], [c[1] for c in cases])
    finally:
        runner.close()
    assert batch.scores.tolist() == pytest.approx([c[2] for c in cases])
    assert batch.malformed.tolist() == [c[3] for c in cases]
    assert batch.failures == 0


def _doc_block(marker: str, lang: str = "python") -> str:
    blocks = re.findall(rf"```{lang}\n(.*?)```\n", DOC.read_text(), re.DOTALL)
    found = [b for b in blocks if marker in b]
    assert len(found) == 1, f"docs/math_and_code.md: expected one {lang} block with {marker!r}, found {len(found)}"
    return found[0]


def _lcb_row(qid, date, cases_public, cases_private, *, starter="", func_name=None, compress=False):
    private = json.dumps(cases_private)
    if compress:  # the lite release's encoding
        private = base64.b64encode(zlib.compress(pickle.dumps(private))).decode()
    return {"question_title": qid, "question_content": f"Problem {qid}.", "platform": "atcoder", "question_id": qid,
            "contest_id": "c", "contest_date": date, "starter_code": starter, "difficulty": "easy",
            "public_test_cases": json.dumps(cases_public), "private_test_cases": private,
            "metadata": json.dumps({"func_name": func_name} if func_name else {})}


def test_docs_livecodebench_converter_gives_tests_the_code_reward_runs(tmp_path):
    from lit_rlvr.data.formats import load_records
    from lit_rlvr.rewards.code import check_tests

    (tmp_path / "lcb_to_jsonl.py").write_text(_doc_block("# lcb_to_jsonl.py"))
    stdin = lambda i, o: {"input": i, "output": o, "testtype": "stdin"}  # noqa: E731
    call = lambda i, o: {"input": i, "output": o, "testtype": "functional"}  # noqa: E731
    _write(tmp_path / "data/lcb/test.jsonl", [
        _lcb_row("a1", "2025-03-01T00:00:00", [stdin("1 2\n", "3\n")], [stdin("10 20\n", "30\n")], compress=True),
        _lcb_row("old", "2024-01-01T00:00:00", [stdin("1 2\n", "3\n")], [])])
    _write(tmp_path / "data/lcb/test6.jsonl", [
        _lcb_row("lc1", "2025-04-01T00:00:00", [call("1\n2", "3")], [call("5\n7", "12")], func_name="addTwo",
                 starter="class Solution:\n    def addTwo(self, a: int, b: int) -> int:\n        ")])
    command = next(line for line in _doc_block("lcb_to_jsonl.py data/", "bash").splitlines()
                   if line.startswith("python lcb_to_jsonl.py"))
    done = subprocess.run(["bash", "-c", command.replace("python ", f"{sys.executable} ", 1)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    records, stats = load_records(str(tmp_path / "data/lcb_v6.jsonl"), fields={"prompt": "prompt", "answer": "tests"})
    assert [r["question_id"] for r in records] == ["a1", "lc1"] and stats["skipped"] == 0
    stdin_rec, call_rec = records
    assert "Read the inputs from stdin" in stdin_rec["prompt"] and "def addTwo" in call_rec["prompt"]
    assert json.loads(call_rec["answer"])["fn_name"] == "addTwo"
    assert check_tests("a, b = map(int, input().split())\nprint(a + b)", stdin_rec["answer"])[0]
    assert check_tests("class Solution:\n    def addTwo(self, a, b):\n        return a + b", call_rec["answer"])[0]
    passed, details = check_tests("class Solution:\n    def addTwo(self, a, b):\n        return a - b",
                                  call_rec["answer"])
    assert not passed and details["status"] == "wrong_answer"


def test_docs_dapo_dedup_keeps_one_copy_per_prompt(tmp_path):
    from lit_rlvr.data.formats import load_records

    copies = [_verl([{"role": "user", "content": f"Problem {i % 3}"}], str(i % 3)) for i in range(9)]
    _write(tmp_path / "data/dapo/data/dapo-math-17k.parquet", copies)
    _write(tmp_path / "data/dapo/data/aime-2024.parquet", copies[:4])
    done = subprocess.run([sys.executable, "-c", _doc_block("first = ~df")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    records, _ = load_records(str(tmp_path / "data/dapo_math_17k.parquet"), fields="dapo_math")
    assert [(r["prompt"][0]["content"], r["answer"]) for r in records] == [(f"Problem {i}", str(i)) for i in range(3)]
    assert len(load_records(str(tmp_path / "data/dapo_aime24.parquet"), fields="dapo_math")[0]) == 3


# ------------------------------------------------------------------------------------------------------
# train.py end to end (the background runs)


def _metric_rows(run_dir: Path) -> list[dict]:
    with (run_dir / "metrics.csv").open() as handle:
        return [row for row in csv.DictReader(handle) if row.get("reward/mean")]


def test_train_on_jsonl_skips_the_bad_row_and_writes_outputs(runs):
    rc, out, err = runs["runs"]["train"].result()
    assert rc == 0, err[-3000:]
    run_dir = runs["dirs"]["train"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["data_rows_skipped"] == 1 and summary["rollouts_total"] == 3 * 4 * 4
    assert 0.0 <= summary["accuracy_after"] <= 1.0
    assert len(_metric_rows(run_dir)) == 3
    assert (run_dir / "checkpoints" / "last.ckpt").exists()
    assert "skipped 1 of 24 rows" in out


def test_eval_mode_reports_accuracy_pass_at_k_and_mean_at_k(runs):
    rc, _, err = runs["runs"]["train"].result()
    assert rc == 0, err[-3000:]
    run_dir = runs["dirs"]["eval"]
    ckpt = runs["dirs"]["train"] / "checkpoints" / "last.ckpt"
    rc, out, err = _Run("eval", ["mode=eval", f"checkpoint={ckpt}", "data=jsonl", f"data.path={runs['files']['ok']}",
                                 "reward=arithmetic", "algorithm.eval_samples=4", "algorithm.eval_temperature=1.0",
                                 f"hydra.run.dir={run_dir}", *SMALL], runs["root"]).result()
    assert rc == 0, err[-3000:]
    result = json.loads((run_dir / "eval.json").read_text())
    assert result["checkpoint"] == str(ckpt)
    assert (result["prompts"], result["samples_per_prompt"], result["temperature"]) == (8, 4, 1.0)
    for key in ("val/accuracy", "val/pass@k", "val/mean@k"):
        assert 0.0 <= result[key] <= 1.0, (key, result)
    assert result["val/mean@k"] == pytest.approx(result["val/accuracy"])
    assert result["val/pass@k"] >= result["val/mean@k"] - 1e-6
    assert result["val/accuracy"] * 32 == pytest.approx(round(result["val/accuracy"] * 32))  # counts of 8 x 4 samples
    assert "val/pass@k" in out and "lit-rlvr eval" in out  # the printed table


def test_bad_row_fails_through_train_py_naming_file_row_and_field(runs):
    rc, _, err = runs["runs"]["bad_row"].result()
    assert rc != 0
    assert f"{runs['files']['bad']}: row 5: field 'answer': missing" in err
    assert "data.on_bad_row=skip" in err
    assert not (runs["dirs"]["bad_row"] / "checkpoints").exists()  # failed before any training


def test_code_reward_path_runs_end_to_end(runs):
    rc, _, err = runs["runs"]["code"].result()
    assert rc == 0, err[-3000:]
    run_dir = runs["dirs"]["code"]
    rows = _metric_rows(run_dir)
    assert len(rows) == 2
    for row in rows:  # the tiny arithmetic model writes no code block: every completion is malformed
        assert float(row["reward/mean"]) == -1.0
        assert 0.0 <= float(row["reward/malformed_frac"]) <= 1.0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["reward_failures"] == 0 and summary["accuracy_after"] == 0.0
    assert (run_dir / "checkpoints" / "last.ckpt").exists()


def test_ranks_split_each_global_batch_and_resume_skips_globally():
    """Rank r takes every world-th index of one global order: the ranks' batches together are the 1-rank batch."""
    from lit_rlvr.data.datamodule import ResumableSampler

    one = list(ResumableSampler(40, seed=3))
    ranks = [list(ResumableSampler(40, seed=3, rank=r, world=2)) for r in range(2)]
    for step in range(4):  # global batch 8 = 4 per rank
        together = sorted(ranks[0][4 * step : 4 * step + 4] + ranks[1][4 * step : 4 * step + 4])
        assert together == sorted(one[8 * step : 8 * step + 8])
    resumed = ResumableSampler(40, seed=3, rank=1, world=2)
    resumed.skip_next(0, 16)  # 2 global batches of 8 already trained on
    assert list(resumed) == ranks[1][8:]
