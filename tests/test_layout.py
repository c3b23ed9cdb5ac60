"""The layout rules of docs/architecture.md §1, checked on the source: which layer may import which, the rollout
driver knows no trainer, callbacks use the module's public API only, and the engine contract is explicit."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import sys
from pathlib import Path

import pytest

from lit_rlvr.callbacks import ValuePrior
from lit_rlvr.hooks import check_rl_callbacks
from lit_rlvr.module import GRPOModule
from lit_rlvr.rollout.batch import Rollouts
from lit_rlvr.rollout.engine import RolloutEngine

ROOT = Path(__file__).resolve().parents[1]
PROBE = re.compile(r"\b(hasattr|getattr)\(\s*[\w.]*engine\b")
# what a callback may use of the module it is given (`pl_module`): its public API
MODULE_API = {"driver", "engine", "policy", "tokenizer", "global_step", "seed_key", "log_metrics", "device",
              "trainer", "global_rank", "group_size"}


def _py_files(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "callbacks":
        parts = ["lit_rlvr", *parts]  # installed as lit_rlvr.callbacks
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _load_time_imports(path: Path) -> set[str]:
    """The lit_rlvr modules `path` imports when it loads: top-level imports, not those inside functions or under
    `if TYPE_CHECKING:` (both run later, or never)."""
    tree = ast.parse(path.read_text())
    package = _module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else _module_name(path)
    found: set[str] = set()

    def visit(nodes):
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, (ast.If, ast.Try)):
                visit(node.body + node.orelse + getattr(node, "finalbody", []) +
                      [n for h in getattr(node, "handlers", []) for n in h.body])
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base
                                                                                                      else []))
                found.add(base)
                found.update(f"{base}.{a.name}" for a in node.names)

    visit(tree.body)
    return {name for name in found if name.startswith("lit_rlvr")}


def _graph(folders: tuple[str, ...]) -> dict[str, set[str]]:
    files = _py_files(*folders)
    names = {_module_name(p) for p in files}
    return {_module_name(p): {n for n in _load_time_imports(p) if n in names} for p in files}


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of `graph` as a list of modules, or []."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := walk(nxt)):
                return found
        state[node] = 2
        stack.pop()
        return []

    for node in sorted(graph):
        if node not in state and (found := walk(node)):
            return found
    return []


def test_no_import_cycle_in_the_library_or_the_benchmarks():
    graph = _graph(("lit_rlvr", "callbacks"))
    assert _cycle(graph) == []
    bench = {f"bench.{p.stem}": {n for n in _load_time_imports(p) if n in graph} | (
        {f"bench.{m}" for m in re.findall(r"^from (?:bench\.)?(\w+) import", p.read_text(), re.M)
         if (ROOT / "bench" / f"{m}.py").exists()}) for p in _py_files("bench")}
    assert _cycle({**graph, **bench}) == []


@pytest.mark.parametrize("layer", ["lit_rlvr.functional", "lit_rlvr.rollout"])
def test_engines_and_math_import_no_module_trainer_or_callback(layer):
    """The math and the engines are usable without Lightning: they import no module, hook or callback."""
    forbidden = ("lit_rlvr.module", "lit_rlvr.hooks", "lit_rlvr.callbacks", "lit_rlvr.recipe", "lit_rlvr.algorithms")
    for path in _py_files(layer.replace(".", "/")):
        text = path.read_text()
        bad = [n for n in _load_time_imports(path) if n.startswith(forbidden)]
        bad += re.findall(r"^\s*(?:import|from) (lightning\S*)", text, re.M)
        assert bad == [], f"{path.relative_to(ROOT)} imports {bad}"


def test_functional_imports_only_torch_and_the_standard_library():
    for path in _py_files("lit_rlvr/functional"):
        imported = {n.split(".")[0] for n in re.findall(r"^\s*(?:import|from) ([\w.]+)", path.read_text(), re.M)}
        assert imported - set(sys.stdlib_module_names) <= {"torch", "lit_rlvr"}, path
        assert {n for n in _load_time_imports(path)} <= {n for n in _load_time_imports(path)
                                                         if n.startswith("lit_rlvr.functional")}, path


def test_the_library_never_imports_the_callbacks_package():
    for path in _py_files("lit_rlvr"):
        assert not [n for n in _load_time_imports(path) if n.startswith("lit_rlvr.callbacks")], path


def test_the_rollout_driver_reads_no_module_or_trainer():
    code = ast.unparse(ast.parse((ROOT / "lit_rlvr/rollout/driver.py").read_text()))  # docstrings may name them
    code = re.sub(r'""".*?"""|\'\'\'.*?\'\'\'', "", code, flags=re.S)
    assert not re.search(r"\bmodule\b|\btrainer\b|\bhparams\b", code)
    assert not any(re.search(r"\bself\.module\b", p.read_text()) for p in _py_files("lit_rlvr/rollout"))


def test_callbacks_use_only_the_public_module_api():
    """`pl_module.X` in a callback names public module API only: no private attribute, no hyperparameter read
    (the module passes its options to `check_module_options`)."""
    used = {}
    for path in _py_files("callbacks"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "pl_module":
                used.setdefault(node.attr, []).append(path.name)
    assert set(used) <= MODULE_API, {k: v for k, v in used.items() if k not in MODULE_API}


def test_nothing_cites_a_design_document_outside_the_repository():
    files = _py_files("lit_rlvr", "callbacks", "bench", "scripts", "tests") + sorted((ROOT / "conf").rglob("*.yaml"))
    files += [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "bench/README.md"]
    citing = [str(p.relative_to(ROOT)) for p in files if p != Path(__file__) and "DESIGN §" in p.read_text()]
    assert citing == []
    assert (ROOT / "docs/architecture.md").exists()


def test_no_engine_probes_outside_the_engines_package():
    """A third engine learns its contract from `RolloutEngine`, not from `hasattr` calls in its callers."""
    files = [p for p in (ROOT / "lit_rlvr").rglob("*.py") if "rollout" not in p.relative_to(ROOT / "lit_rlvr").parts]
    files += list((ROOT / "callbacks").glob("*.py"))
    probes = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in files
              for i, line in enumerate(p.read_text().splitlines(), 1) if PROBE.search(line)]
    assert probes == []


def test_the_engine_contract_has_defaults_for_all_but_generation_and_weights():
    class Minimal(RolloutEngine):
        def generate(self, prompt_token_ids, n_per_prompt, params):
            return [[] for _ in prompt_token_ids]

        def load_weights(self, named_tensors):
            self.loaded = list(named_tensors)

    engine = Minimal()
    engine.sleep(), engine.wake(), engine.end_weight_update(), engine.shutdown()
    assert engine.to("cpu") is engine and engine.holds_weights and engine.generation_dtype() is None
    assert not engine.shares_weights and not engine.can_generate_stacked and engine.weight_dtype is None


def test_the_batch_carries_per_step_data_only():
    """Loss options (`scale_adv_by_std`, `seq_mask_tau`) are the module's; the batch holds no copy of them."""
    names = {f.name for f in dataclasses.fields(Rollouts)}
    assert not names & {"scale_adv_by_std", "seq_mask_tau", "chunk"} and "source" in names
    assert {"scale_adv_by_std", "seq_mask_tau"} <= set(inspect.signature(GRPOModule.__init__).parameters)


def test_seq_mask_tau_is_checked_by_the_module():
    with pytest.raises(ValueError, match=r"algorithm\.seq_mask_tau=1\.0"):
        GRPOModule(seq_mask_tau=1.0)  # fails in the option checks, before the model loads


def test_k_init_follows_the_module_group_size():
    options = {"group_size": 6, "scale_adv_by_std": False}
    callback = ValuePrior(value_model=object())  # a ready V0: setup builds nothing
    check_rl_callbacks([callback], options)
    assert callback.k_init == 6
    explicit = ValuePrior(k_init=2, value_model=object())
    check_rl_callbacks([explicit], options)
    assert explicit.k_init == 2
