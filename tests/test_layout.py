"""The layout rules of docs/architecture.md §1, checked on the source: which layer may import which, no import
inside a function, every error class in one file, a short top level, the rollout driver knows no trainer, callbacks
use the module's public API only, and the engine contract is explicit."""

from __future__ import annotations

import ast
import builtins
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lit_rlvr.config.settings import AlgorithmConfig, LossConfig
from lit_rlvr.callbacks import ValuePrior
from lit_rlvr.hooks import check_rl_callbacks
from lit_rlvr.module import GRPOModule
from lit_rlvr.rollout.batch import Rollouts
from lit_rlvr.rollout.engine import RolloutEngine

ROOT = Path(__file__).resolve().parents[1]
PROBE = re.compile(r"\b(hasattr|getattr)\(\s*[\w.]*engine\b")
# what a callback may use of the module it is given (`pl_module`): its public API
MODULE_API = {"driver", "source", "engine", "policy", "tokenizer", "global_step", "seed_key", "log_metrics",
              "device", "trainer", "global_rank", "group_size"}
# low -> high: a module imports from its own layer or the layers below (docs/architecture.md §1). A module's layer is
# its folder's (the name under lit_rlvr/: a folder, or a file directly under it; "" is lit_rlvr/__init__.py): the
# table names folders only, never a file inside one
LAYERS = (
    ("functional",),
    ("config",),
    ("run",),
    ("rewards", "data", "envs", "models", "value", "optim", "strategies"),
    ("rollout", "update"),
    ("hooks", "module", "algorithms"),
    ("callbacks",),
    ("app", ""),
)
MODULE_LINES = 350  # lit_rlvr/module.py: the step orchestrated, its parts elsewhere (docs/architecture.md §1)
# modules that only the engines' own servers load, over their packages (vllm): not importable without them
SERVER_SIDE = {"lit_rlvr.rollout.vllm_server_worker"}
TOP_LEVEL_FILES = 3  # .py files directly under lit_rlvr/: __init__, module, hooks; the rest in folders
# lit-rlvr modules imported inside a function: the engines over optional extras (imported when chosen)
LAZY_EXTRAS = {("lit_rlvr/rollout/__init__.py", "lit_rlvr.rollout.sglang"),
               ("lit_rlvr/rollout/__init__.py", "lit_rlvr.rollout.vllm")}
ERRORS_FILE = "lit_rlvr/config/errors.py"
# error classes still beside their code, in files being rewritten by other changes; they move to ERRORS_FILE next
ERRORS_ELSEWHERE = {"EngineError", "EngineSyncError"}


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
    # importing lit_rlvr.a.b runs lit_rlvr/a/__init__.py first (but a module's own packages are already loading)
    own = {package.rsplit(".", k)[0] for k in range(package.count(".") + 1)} | {_module_name(path)}
    found |= {name.rsplit(".", k)[0] for name in found for k in range(1, name.count(".") + 1)}
    return {name for name in found if name.startswith("lit_rlvr") and name not in own}


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


@pytest.mark.parametrize("layer", ["lit_rlvr.functional", "lit_rlvr.rollout", "lit_rlvr.update"])
def test_engines_math_and_update_import_no_module_trainer_or_callback(layer):
    """The math, the engines and the update are usable without Lightning: they import no module, hook or
    callback."""
    forbidden = ("lit_rlvr.module", "lit_rlvr.hooks", "lit_rlvr.callbacks", "lit_rlvr.app", "lit_rlvr.algorithms")
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
    """Not when it loads: `lit_rlvr/__init__.py`'s lazy names reach the callbacks only when a user asks for one
    (checked by `test_the_public_names_import_from_the_package_on_first_use`)."""
    for path in _py_files("lit_rlvr"):
        assert not [n for n in _load_time_imports(path) if n.startswith("lit_rlvr.callbacks")], path


def _folder(module: str) -> str:
    """The name under lit_rlvr/ that holds `module` (lit_rlvr.rollout.hf -> "rollout"; lit_rlvr -> "")."""
    return module.split(".")[1] if "." in module else ""


def _layer(module: str) -> int:
    owners = [i for i, layer in enumerate(LAYERS) if _folder(module) in layer]
    assert owners, f"{module}: its folder {_folder(module)!r} is in no layer of LAYERS (docs/architecture.md §1)"
    return owners[0]


def test_every_folder_is_in_exactly_one_layer():
    folders = {p.name for p in (ROOT / "lit_rlvr").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    folders |= {p.stem for p in (ROOT / "lit_rlvr").glob("*.py") if p.stem != "__init__"} | {"callbacks", ""}
    listed = [name for layer in LAYERS for name in layer]
    assert sorted(listed) == sorted(folders)


def test_imports_point_down_the_layers():
    """Read from the folders alone: no import, at load time, of a module in a higher layer than its own."""
    upward = [f"{module} -> {name}" for module, names in _graph(("lit_rlvr", "callbacks")).items()
              for name in sorted(names) if _layer(name) > _layer(module)]
    assert upward == []


def test_the_rollout_and_the_update_load_no_lightning():
    """Not directly (`test_engines_math_and_update_import_no_module_trainer_or_callback`) and not through a module
    they import: the engines, the driver and the update run without Lightning installed in the process."""
    code = f"""
SERVER_SIDE = {sorted(SERVER_SIDE)!r}
import importlib, pkgutil, sys
import lit_rlvr.rollout, lit_rlvr.update
for package in (lit_rlvr.rollout, lit_rlvr.update):
    for found in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
        if found.name not in SERVER_SIDE:
            importlib.import_module(found.name)
print(sorted(n for n in sys.modules if n.split(".")[0] == "lightning"))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", proc.stdout[-2000:]


def test_the_module_is_thin():
    """`GRPOModule` orchestrates the step; the step's parts live in their folders."""
    lines = len((ROOT / "lit_rlvr/module.py").read_text().splitlines())
    assert lines <= MODULE_LINES, f"lit_rlvr/module.py has {lines} lines; at most {MODULE_LINES}"


def test_no_lit_rlvr_import_inside_a_function():
    """A dependency that runs back up is fixed by moving code to its layer, not by importing late; the only lazy
    imports of lit-rlvr modules are the engines over optional extras."""
    late = []
    for path in _py_files("lit_rlvr", "callbacks"):
        rel = str(path.relative_to(ROOT))
        for func in ast.walk(ast.parse(path.read_text())):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(func):
                names = ([node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else
                         [a.name for a in node.names] if isinstance(node, ast.Import) else [])
                relative = isinstance(node, ast.ImportFrom) and node.level > 0
                late += [f"{rel}:{node.lineno} {name or '.'}" for name in names + (["<relative>"] if relative else [])
                         if (relative or name.startswith("lit_rlvr")) and (rel, name) not in LAZY_EXTRAS]
    assert late == []


def test_every_error_class_is_in_the_errors_file():
    classes = [(node, str(path.relative_to(ROOT))) for path in _py_files("lit_rlvr", "callbacks")
               for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)]
    errors = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}
    while True:  # subclasses of exceptions, to a fixed point
        more = {node.name for node, _ in classes if any(ast.unparse(b).split(".")[-1] in errors for b in node.bases)}
        if more <= errors:
            break
        errors |= more
    public = {(node.name, rel) for node, rel in classes if node.name in errors and not node.name.startswith("_")}
    elsewhere = {name for name, rel in public if rel != ERRORS_FILE}
    assert elsewhere == ERRORS_ELSEWHERE
    assert _load_time_imports(ROOT / ERRORS_FILE) == set()


def test_the_top_level_of_the_package_is_short():
    files = sorted(p.name for p in (ROOT / "lit_rlvr").glob("*.py"))
    assert len(files) <= TOP_LEVEL_FILES, files


def test_the_public_names_import_from_the_package_on_first_use():
    """`import lit_rlvr` loads neither torch (reward workers import `lit_rlvr.config`) nor the callbacks; the
    public classes are the ones their modules define."""
    code = """
import sys
import lit_rlvr
import lit_rlvr.config.errors
assert "torch" not in sys.modules and "lit_rlvr.callbacks" not in sys.modules, sorted(sys.modules)
from lit_rlvr import GRPOModule, RLVRDataModule, ParamNoise, ValuePrior, SamplingConfig, LoraOptions
from lit_rlvr.callbacks import ParamNoise as callback
from lit_rlvr.data.datamodule import RLVRDataModule as data
from lit_rlvr.module import GRPOModule as module
assert (GRPOModule, RLVRDataModule, ParamNoise) == (module, data, callback)
assert set(lit_rlvr.__all__) <= set(dir(lit_rlvr)) and all(getattr(lit_rlvr, n) for n in lit_rlvr.__all__)
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("path", ["lit_rlvr/rollout/driver.py", *(f"lit_rlvr/update/{p.name}" for p in
                                                                   sorted((ROOT / "lit_rlvr/update").glob("*.py")))])
def test_the_rollout_driver_and_the_update_read_no_module_or_trainer(path):
    """The driver and its twin, the update, are built from explicit parts: no module, trainer or settings bag."""
    code = ast.unparse(ast.parse((ROOT / path).read_text()))  # docstrings may name them
    code = re.sub(r'""".*?"""|\'\'\'.*?\'\'\'', "", code, flags=re.S)
    assert not re.search(r"\bmodule\b|\btrainer\b|\bhparams\b", code), path
    folder = (ROOT / path).parent
    assert not any(re.search(r"\bself\.module\b", p.read_text()) for p in folder.glob("*.py"))


def test_callbacks_use_only_the_public_module_api():
    """`pl_module.X` in a callback names public module API only: no private attribute, no hyperparameter read
    (the module passes its algorithm settings to `check_algorithm`)."""
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
    """Loss settings (`scale_adv_by_std`, `seq_mask_tau`) are the algorithm's; the batch holds no copy of them."""
    names = {f.name for f in dataclasses.fields(Rollouts)}
    assert not names & {"scale_adv_by_std", "seq_mask_tau", "chunk"} and "source" in names
    assert {"scale_adv_by_std", "seq_mask_tau"} <= {f.name for f in dataclasses.fields(LossConfig)}


def test_seq_mask_tau_is_checked_by_the_module():
    with pytest.raises(ValueError, match=r"algorithm\.seq_mask_tau=1\.0"):
        GRPOModule(seq_mask_tau=1.0)  # fails in the option checks, before the model loads


def test_k_init_follows_the_module_group_size():
    options = AlgorithmConfig(group_size=6, scale_adv_by_std=False)
    callback = ValuePrior(value_model=object())  # a ready V0: setup builds nothing
    check_rl_callbacks([callback], options)
    assert callback.k_init == 6
    explicit = ValuePrior(k_init=2, value_model=object())
    check_rl_callbacks([explicit], options)
    assert explicit.k_init == 2
