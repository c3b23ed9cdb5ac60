"""Mutation testing of the math, the optimizer, the two paper callbacks, the batch helpers and the training
machinery around them (the update, the async pipeline, weight sync, DAPO's filter, rewards, settings, the stop
request): how much of what the tests claim to check would they notice if it broke?

A small AST mutator of our own (the mutants: scripts/mutants.py; why not mutmut or cosmic-ray, and how to use it:
docs/mutation.md). Each mutant changes one operator, constant or condition of a target file; it is *killed* when a
test that runs the mutated line fails (or runs past its CPU or wall-clock bound: killed by timeout). Score = killed /
(mutants − equivalent ones), the equivalent ones listed with their reason in scripts/mutation_equivalents.toml.

How it stays cheap on two shared cores:
  1. one coverage run of the candidate tests (pytest-cov, a context per test) tells which tests run each line;
  2. a parent process imports torch, Lightning, transformers and the tests once; each mutant runs in a forked
     child that imports our package afresh with the mutated module compiled from the changed AST, and runs only
     the tests that execute the mutated line (`-x`: the first failure ends it).

Usage: `nice -n 15 python scripts/mutation.py [--jobs 2] [--only PATH ...] [--out docs/results/mutation.md]`.
What is mutated and which tests may kill it: `TARGETS` and `TESTS` below, the one place to add a file.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.abc
import importlib.util
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Optional

from mutants import Mutant, list_mutants, mutated_code  # scripts/ is on sys.path when this file runs

REPO = Path(__file__).resolve().parents[1]

# What is mutated: files, or folders (every .py file in them but __init__.py). Add new math files here.
TARGETS = (
    "lit_rlvr/functional/",
    "lit_rlvr/optim/ivon.py",
    "callbacks/param_noise.py",
    "callbacks/value_prior.py",
    "lit_rlvr/rollout/batch.py",
    "lit_rlvr/update/",
    "lit_rlvr/rollout/pipeline.py",
    "lit_rlvr/rollout/segments.py",
    "lit_rlvr/rollout/weight_sync.py",
    "lit_rlvr/rollout/weights.py",
    "lit_rlvr/algorithms/filter_groups.py",
    "lit_rlvr/rewards/terms.py",
    "lit_rlvr/rewards/base.py",
    "lit_rlvr/rewards/remote.py",
    "lit_rlvr/config/settings.py",
    "lit_rlvr/run/stop.py",
)
# The tests that may kill them (fast ones: unit tests of these files). Coverage picks, per mutated line, the
# tests of this list that run it.
TESTS = (
    "tests/test_functional.py",
    "tests/test_functional_edges.py",
    "tests/test_fidelity.py",
    "tests/test_flops.py",
    "tests/test_rollout_correction.py",
    "tests/test_passk.py",
    "tests/test_micro_batches.py",
    "tests/test_micro_batch_tokens.py",
    "tests/test_value_prior_functional.py",
    "tests/test_ivon.py",
    "tests/test_param_noise.py",
    "tests/test_value_prior_callback.py",
    "tests/test_algorithms.py",
    "tests/test_batch.py",
    "tests/test_multi_weight.py",
    "tests/test_ivon_edges.py",
    "tests/test_value_prior_edges.py",
    "tests/test_param_noise_edges.py",
    "tests/test_batch_edges.py",
    # the update, the async pipeline, weight sync, DAPO's filter, rewards, settings, the stop request (issue 61)
    "tests/test_update.py",
    "tests/test_update_loss_terms.py",
    "tests/test_group_filter_refill.py",
    "tests/test_rollout_pipeline.py",
    "tests/test_pipeline_staleness.py",
    "tests/test_segment_boundaries.py",
    "tests/test_weight_sync.py",
    "tests/test_weight_push_paths.py",
    "tests/test_settings.py",
    "tests/test_settings_ranges.py",
    "tests/test_rewards_terms.py",
    "tests/test_reward_terms_edges.py",
    "tests/test_reward_contract_bounds.py",
    "tests/test_rewards_remote.py",
    "tests/test_reward_client_urls.py",
    "tests/test_stop_request_grace.py",
)
EQUIVALENTS = REPO / "scripts" / "mutation_equivalents.toml"
# every pytest run: quiet, no cache writes, the end-to-end runs left out (minutes each)
PYTEST_ARGS = ("-q", "-p", "no:cacheprovider", "--no-header", "-W", "ignore", "-m", "not slow")
# our packages: imported afresh in every mutant's child
OWN_PREFIXES = ("lit_rlvr", "callbacks", "tests", "conftest")


def module_names(rel: str) -> list[str]:
    """Import names of a repository file (callbacks/ installs as lit_rlvr.callbacks)."""
    dotted = rel[:-3].replace("/", ".")
    return [dotted, "lit_rlvr." + dotted] if rel.startswith("callbacks/") else [dotted]


def target_files(only: Optional[list[str]]) -> list[Path]:
    files = []
    for target in TARGETS:
        path = REPO / target
        found = sorted(p for p in path.glob("*.py") if p.name != "__init__.py") if target.endswith("/") else [path]
        files += found
    if only:
        files = [f for f in files if any(str(f.relative_to(REPO)).startswith(o) for o in only)]
    return files


# -- which tests run which line -----------------------------------------------------------------------------------
def coverage_map(files: list[Path], data_file: Path) -> dict[str, dict[int, set[str]]]:
    """{file: {line: test node ids}} from one pytest-cov run of TESTS with a context per test."""
    if not data_file.exists():
        include = ",".join(str(f) for f in files)
        cmd = [sys.executable, "-m", "pytest", *PYTEST_ARGS, "-rf", "--durations=0", "--durations-min=0", "--cov",
               "--cov-context=test",
               f"--cov-config={data_file}.rc", "--cov-report=", *TESTS]
        data_file.with_name(data_file.name + ".rc").write_text(
            f"[run]\ndata_file = {data_file}\ninclude = {include}\n")
        print(f"coverage run of {len(TESTS)} test files ...", flush=True)
        started = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        failed = re.findall(r"^FAILED (\S+)", proc.stdout, flags=re.M)
        if proc.returncode not in (0, 1) or (proc.returncode == 1 and not failed):
            sys.exit(f"the coverage run of the tests did not finish:\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}")
        Path(f"{data_file}.failed").write_text("".join(f"{f}\n" for f in failed))
        durations: dict[str, float] = {}
        for seconds, node in re.findall(r"^\s*([\d.]+)s (?:setup|call|teardown)\s+(\S+)", proc.stdout, flags=re.M):
            durations[node] = durations.get(node, 0.0) + float(seconds)
        Path(f"{data_file}.durations").write_text(json.dumps(durations))
        Path(f"{data_file}.load").write_text(f"{os.getloadavg()[0]}\n")  # the load the durations were taken at
        print(f"  done in {time.perf_counter() - started:.0f} s; failing without a mutant (left out): "
              f"{failed or 'none'}", flush=True)
    from coverage import CoverageData

    data = CoverageData(basename=str(data_file))
    data.read()
    broken = set(Path(f"{data_file}.failed").read_text().split()) if Path(f"{data_file}.failed").exists() else set()
    out: dict[str, dict[int, set[str]]] = {}
    for measured in data.measured_files():
        rel = str(Path(measured).resolve().relative_to(REPO))
        by_line = data.contexts_by_lineno(measured)
        out[rel] = {line: {c.rsplit("|", 1)[0] for c in contexts if c.endswith(("|run", "|setup"))} - broken
                    for line, contexts in by_line.items()}
    return out


def tests_for(mutant: Mutant, covered: dict[int, set[str]], first_line: dict[int, int],
              durations: dict[str, float], max_seconds: float, functions: set[str]) -> list[str]:
    """Tests that run the mutated statement (looked up on the node's line and its statement's first line); for a
    node outside any function (constants, class bodies: run at import, where no test's context counts it) also
    every test that runs any line of the file, since a lambda on the same line (a settings rule) may be run by a
    few tests only; likewise for a line that only import runs (a default argument). Fastest first: with `-x` the
    first failure ends the run."""
    lines = {mutant.line, first_line.get(mutant.line, mutant.line)}
    tests = set().union(*(covered.get(line, set()) for line in lines))
    at_import = mutant.function not in functions or not tests  # e.g. a default argument: run at def time
    if at_import and any(line in covered for line in lines):
        tests |= set().union(*covered.values())
    tests = {t for t in tests if durations.get(t, 0.0) <= max_seconds}  # whole-run tests: too slow per mutant
    return sorted(tests, key=lambda t: (durations.get(t, math.inf), t))


def function_names(path: Path) -> set[str]:
    """Qualified names of the functions (and methods) defined in `path`, as a mutant's `function` names them."""
    names: set[str] = set()

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    names.add(name)
                walk(child, name + ".")
            else:
                walk(child, prefix)

    walk(ast.parse(path.read_text()), "")
    return names


def statement_first_lines(path: Path) -> dict[int, int]:
    """{line: first line of the innermost simple statement that spans it} (coverage counts statements there)."""
    first = {}
    simple = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.stmt) and not isinstance(
        n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.If, ast.For, ast.While, ast.With, ast.Try))]
    for node in sorted(simple, key=lambda n: (n.end_lineno or n.lineno) - n.lineno, reverse=True):
        for line in range(node.lineno, (node.end_lineno or node.lineno) + 1):
            first[line] = node.lineno  # shorter (inner) statements written last win
    return first


# -- running a mutant in a forked child ---------------------------------------------------------------------------
class _MutantFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names: list[str], path: Path, code):
        self.names, self.path, self.code = set(names), path, code

    def find_spec(self, name, path=None, target=None):
        if name in self.names:
            return importlib.util.spec_from_file_location(name, self.path, loader=self)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__file__ = str(self.path)
        exec(self.code, module.__dict__)


def _purge_own_modules() -> None:
    """Forget our modules, and every module loaded from the repository's tests/ (a test file imported by another
    under its bare name, `test_x`, would otherwise keep the unmutated classes it bound at preload)."""
    tests = str(REPO / "tests")
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] in OWN_PREFIXES or str(getattr(module, "__file__", "") or "").startswith(tests):
            del sys.modules[name]


def start_child(mutant: Optional[Mutant], tests: list[str]) -> int:
    """Fork a child that runs `tests` against `mutant` (None: the code as it is); returns its pid."""
    pid = os.fork()
    if pid:
        return pid
    code = 3
    try:
        os.setpgrp()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # no entry-point scan of every installed package
        _purge_own_modules()
        if mutant is not None:
            path = REPO / mutant.file
            sys.meta_path.insert(0, _MutantFinder(module_names(mutant.file), path,
                                                  mutated_code(path, mutant.index)))
            try:  # a mutant that breaks an import (a default refused at import time) is noticed there: killed
                for module in ["conftest", *sorted({t.split("::")[0][:-3].replace("/", ".") for t in tests})]:
                    importlib.import_module(module)
            except Exception:  # noqa: BLE001 - pytest would report it as a usage error (exit 4), not a failure
                os._exit(1)
        import pytest

        code = int(pytest.main(["-x", *PYTEST_ARGS, *tests]))
    except BaseException:  # noqa: BLE001 - whatever happens, the child must exit
        code = 3
    finally:
        os._exit(code)


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, its finished children included) of a running process, from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime, stime, cutime, cstime


def wall_limit(baseline: float, factor: float, base: float, baseline_load: float) -> float:
    """Wall-clock bound of one mutant's test run: `factor` × its tests' durations in the coverage run + `base`
    seconds (the child's imports), stretched when the machine is busier now than during the coverage run (load
    average per core, now over then: a starved child is slower, not stuck). A mutant that deadlocks (threads
    waiting on each other use no CPU, so the CPU bound never fires) is ended here and counts as killed by timeout,
    as mutmut counts one."""
    busier = os.getloadavg()[0] / max(baseline_load, os.cpu_count() or 1)
    return factor * baseline * max(1.0, busier) + base


def run_all(mutants: list[Mutant], jobs: int, limits: dict[int, tuple[float, float, float]], save) -> None:
    """Run the pending mutants, `jobs` children at a time; fills status and seconds. Survivors are printed as they
    are found; `save()` is called every 25 mutants (an interrupted run can be resumed from its JSON).

    Two bounds end a child, both counted as a kill by timeout (`timeout`): CPU seconds (`limits[id][0]`: a
    mutant that loops) and wall seconds (`wall_limit` of `limits[id][1:]`: a mutant that deadlocks)."""
    pending = [m for m in mutants if m.status == "pending"]
    running: dict[int, tuple[Mutant, float, float]] = {}
    done = 0
    total = len(pending)
    started_all = time.perf_counter()
    while pending or running:
        while pending and len(running) < jobs:
            mutant = pending.pop(0)
            wall = wall_limit(*limits[id(mutant)][1:])
            running[start_child(mutant, mutant.tests)] = (mutant, time.perf_counter(), wall)
        time.sleep(0.05)
        for pid, (mutant, started, wall) in list(running.items()):
            finished, status = os.waitpid(pid, os.WNOHANG)
            elapsed = time.perf_counter() - started
            if not finished:
                over_cpu = cpu_seconds(pid) > limits[id(mutant)][0]
                if over_cpu or elapsed > wall:
                    try:
                        os.killpg(pid, 9)
                    except ProcessLookupError:  # not yet its own group
                        os.kill(pid, 9)
                    os.waitpid(pid, 0)
                    mutant.status, mutant.seconds = "timeout", elapsed
                    print(f"  timeout ({'CPU' if over_cpu else f'wall {wall:.0f} s'}): {mutant.file}:{mutant.line}:"
                          f"{mutant.column} `{mutant.description}` in `{mutant.source}`", flush=True)
                    del running[pid]
                    done += 1
                    if done % 25 == 0 or done == total:
                        save()
                continue
            code = os.waitstatus_to_exitcode(status)
            mutant.seconds = elapsed
            mutant.status = ("survived" if code == 0 else "no_tests" if code == 5 else
                             "error" if code in (3, 4) or code < 0 else "killed")
            del running[pid]
            done += 1
            if mutant.status not in ("killed", "timeout"):
                print(f"  {mutant.status}: {mutant.file}:{mutant.line}:{mutant.column} `{mutant.description}` in "
                      f"`{mutant.source}`", flush=True)
            if done % 25 == 0 or done == total:
                save()
                rate = (time.perf_counter() - started_all) / done
                print(f"  {done}/{total} mutants, {rate:.1f} s each, ~{rate * (total - done) / 60:.0f} min left",
                      flush=True)


def clean_check(tests: list[str]) -> None:
    """The unmutated code passes `tests` in a child set up as the mutants' are (else every mutant would 'die')."""
    _, status, usage = os.wait4(start_child(None, tests), 0)
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"the tests fail on the unmutated code in a mutant's child: {' '.join(tests)}")
    print(f"clean check: {len(tests)} tests pass in {usage.ru_utime + usage.ru_stime:.1f} CPU s", flush=True)


def preload() -> None:
    """Import the third-party modules the tests use, once, in the parent (the children inherit them)."""
    import torch

    torch.set_num_threads(1)  # no OpenMP pool before fork; two cores shared
    sys.path[:0] = [str(REPO / "tests"), str(REPO)]  # as pytest's rootdir conftest and `pythonpath = .` do
    importlib.import_module("conftest")  # its environment settings, before the tests' modules read them
    for test in TESTS:
        try:
            importlib.import_module(test[:-3].replace("/", "."))
        except Exception as exc:  # noqa: BLE001 - the children import it again and report
            print(f"preload: {test}: {exc!r}", flush=True)
    import pytest  # noqa: F401

    _purge_own_modules()


# -- the report --------------------------------------------------------------------------------------------------
def load_equivalents() -> dict[tuple, str]:
    if not EQUIVALENTS.exists():
        return {}
    entries = tomllib.loads(EQUIVALENTS.read_text()).get("equivalent", [])
    return {(e["file"], e["function"], e["source"], e["mutation"], e["column"],
             *([e["repeat"]] if e.get("repeat") else [])): e["reason"] for e in entries}


def write_report(mutants: list[Mutant], out: Path, runs: list[dict]) -> float:
    counted = [m for m in mutants if m.status != "equivalent"]
    killed = [m for m in counted if m.status in ("killed", "timeout")]
    score = len(killed) / max(len(counted), 1)
    machine = _cpu_name()
    lines = [
        "# Mutation score",
        "",
        f"Score = killed / non-equivalent mutants = {len(killed)} / {len(counted)} = **{score:.1%}** "
        f"({len(mutants)} mutants, {len(mutants) - len(counted)} equivalent).",
        "",
        f"Machine: {machine}, shared with other work (the load average is given per run). Runs that made this "
        "result (a run with `--resume` re-runs only the mutants the previous one did not kill, after tests were "
        "added; a killed mutant stays killed as long as the test that killed it is there):",
        "",
        *[f"- `{r['command']}`: started with {r['mutants_run']} mutants to run, ran {r['seconds'] / 60:.1f} min "
          f"({r['date']}, load average {r['load']:.1f} at its last save)" for r in runs],
        "",
        "The tool and its choices: `scripts/mutation.py` (module docstring; `TARGETS` and `TESTS` name what is "
        "mutated and which tests may kill it). Equivalent mutants and their reasons: "
        "`scripts/mutation_equivalents.toml`.",
        "",
        "| file | mutants | killed | survived | equivalent | no test runs the line | not run yet | score (run ones) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for rel in sorted({m.file for m in mutants}):
        ms = [m for m in mutants if m.file == rel]
        k = sum(m.status in ("killed", "timeout") for m in ms)
        eq = sum(m.status == "equivalent" for m in ms)
        s = sum(m.status == "survived" for m in ms)
        nt = sum(m.status in ("no_tests", "error") for m in ms)
        pend = sum(m.status == "pending" for m in ms)
        run = len(ms) - eq - pend
        lines.append(f"| `{rel}` | {len(ms)} | {k} | {s} | {eq} | {nt} | {pend} | "
                     f"{f'{k / run:.1%}' if run else '—'} |")
    lines += ["", "## Survivors (not killed, not equivalent)", ""]
    survivors = [m for m in counted if m not in killed and m.status != "pending"]
    pending = [m for m in counted if m.status == "pending"]
    if pending:
        ran = len(counted) - len(pending)
        lines[2:2] = [f"**Incomplete: {len(pending)} mutants were not run yet** (counted as not killed above). Of "
                      f"the {ran} non-equivalent mutants run, {len(killed)} were killed: "
                      f"{len(killed) / max(ran, 1):.1%}. Finish with `--resume`.", ""]
    lines += [f"- `{m.file}:{m.line}:{m.column}` ({m.function or 'module'}) {m.status}: `{m.description}` in "
              f"`{m.source}`" for m in survivors] or ["none"]
    lines += ["", "## Equivalent mutants", ""]
    lines += [f"- `{m.file}:{m.line}:{m.column}` ({m.function or 'module'}): `{m.description}` in `{m.source}` — "
              f"{m.reason}" for m in mutants if m.status == "equivalent"] or ["none"]
    out.write_text("\n".join(lines) + "\n")
    return score


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + f" ({os.cpu_count()} cores)"
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1, help="mutants run at once (default 1)")
    parser.add_argument("--only", nargs="*", help="repository paths (prefixes) to mutate, default: TARGETS")
    parser.add_argument("--out", default="docs/results/mutation.md")
    parser.add_argument("--json", default="docs/results/mutation.json", help="every mutant with its status")
    parser.add_argument("--coverage", default="/tmp/lit_rlvr_mutation.coverage",
                        help="coverage data file; reused when it exists (delete it after changing tests)")
    parser.add_argument("--tests", nargs="*", help="test files instead of TESTS (a quick look at one file)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the killed mutants of --json and run the others again (after adding tests)")
    parser.add_argument("--max-test-seconds", type=float, default=8.0,
                        help="tests that took longer in the coverage run are not run against mutants (default 8: "
                             "the few end-to-end Trainer runs; the unit tests are what should kill a mutant)")
    parser.add_argument("--timeout-factor", type=float, default=3.0,
                        help="a mutant's test run is ended after this many times its tests' durations in the "
                             "coverage run (stretched when the machine is busier than then) + --timeout-base seconds "
                             "of wall time, and counts as killed by timeout (default 3)")
    parser.add_argument("--timeout-base", type=float, default=60.0,
                        help="wall seconds added to every mutant's bound: the child's imports (default 60)")
    parser.add_argument("--report-only", action="store_true", help="write the report from --json and exit")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = parser.parse_args()
    if args.tests:
        global TESTS
        TESTS = tuple(args.tests)
    started = time.perf_counter()
    files = target_files(args.only)
    mutants = [m for f in files for m in list_mutants(f)]
    if args.list:
        for m in mutants:
            print(f"{m.file}:{m.line}:{m.column} [{m.function}] {m.description}: {m.source}")
        print(f"{len(mutants)} mutants")
        return
    runs: list[dict] = []
    if args.report_only:
        previous = json.loads((REPO / args.json).read_text())
        done = [Mutant(**{k: v for k, v in m.items() if k not in ("key", "tests")}) for m in previous["mutants"]]
        equivalents = load_equivalents()
        for m in done:
            if m.status == "timeout" and not previous.get("cpu_limits"):
                m.status = "hung"  # a wall-clock limit on a loaded machine: not evidence of a kill
            if m.key in equivalents and m.status not in ("killed", "timeout"):
                m.status, m.reason = "equivalent", equivalents[m.key]
        print(f"score {write_report(done, REPO / args.out, previous['runs']):.1%}; report in {args.out}")
        return
    if args.resume:
        previous = json.loads((REPO / args.json).read_text())
        runs = previous["runs"]
        kept = ("killed", "timeout") if previous.get("cpu_limits") else ("killed",)  # wall timeouts: run again
        killed = {tuple(m["key"]) for m in previous["mutants"] if m["status"] in kept}
        for m in mutants:
            if m.key in killed:
                m.status = next(p["status"] for p in previous["mutants"] if tuple(p["key"]) == m.key)
    covered = coverage_map(files, Path(args.coverage))
    equivalents = load_equivalents()
    timing = Path(f"{args.coverage}.durations")
    durations = json.loads(timing.read_text()) if timing.exists() else {}
    first_lines = {f: statement_first_lines(REPO / f) for f in {m.file for m in mutants}}
    functions = {f: function_names(REPO / f) for f in {m.file for m in mutants}}
    for m in mutants:
        if m.status in ("killed", "timeout"):
            continue
        m.status = "pending"
        if m.key in equivalents:
            m.status, m.reason = "equivalent", equivalents[m.key]
            continue
        m.tests = tests_for(m, covered.get(m.file, {}), first_lines[m.file], durations, args.max_test_seconds,
                            functions[m.file])
        if not m.tests:
            m.status = "no_tests"
    preload()
    # per mutant: CPU limit 5 × its tests' durations in the coverage run (slower than plain) + 20 s of imports;
    # the wall-clock limit's baseline and settings (wall_limit)
    baseline = {id(m): sum(durations.get(t, 1.0) for t in m.tests) for m in mutants}
    loaded = Path(f"{args.coverage}.load")
    baseline_load = float(loaded.read_text()) if loaded.exists() else 0.0
    limits = {id(m): (5 * baseline[id(m)] + 20, baseline[id(m)], args.timeout_factor, args.timeout_base,
                      baseline_load) for m in mutants}
    fastest = sorted({t for m in mutants for t in m.tests}, key=lambda t: durations.get(t, math.inf))[:30]
    if fastest:
        clean_check(fastest)
    command = " ".join([f"nice -n {os.nice(0)} python scripts/mutation.py", *sys.argv[1:]])
    run = {"command": command, "mutants_run": sum(m.status == "pending" for m in mutants), "seconds": 0.0,
           "date": time.strftime("%Y-%m-%d %H:%M"), "load": 0.0}
    runs.append(run)

    def save() -> None:
        run["seconds"], run["load"] = time.perf_counter() - started, os.getloadavg()[0]
        rows = [{**{k: v for k, v in m.__dict__.items() if k != "tests"}, "key": list(m.key)} for m in mutants]
        (REPO / args.json).write_text(json.dumps({"runs": runs, "mutants": rows, "cpu_limits": True}) + "\n")

    run_all(mutants, args.jobs, limits, save)
    save()
    score = write_report(mutants, REPO / args.out, runs)
    print(f"score {score:.1%}; report in {args.out}; {run['seconds'] / 60:.1f} min")


if __name__ == "__main__":
    main()
