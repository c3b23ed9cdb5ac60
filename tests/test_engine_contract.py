"""The engine contract of docs/architecture.md §7 against the engine classes: every documented member exists on
`RolloutEngine` and each engine, and no engine has a public member the table does not list (class attributes,
methods, properties, and every `self.x = ...` in its source)."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from lit_rlvr.rollout.engine import RolloutEngine
from lit_rlvr.rollout.hf import HFEngine
from lit_rlvr.rollout.hf_process import HFProcessEngine
from lit_rlvr.rollout.sglang import SGLangEngine
from lit_rlvr.rollout.sglang_server import SGLangServerEngine
from lit_rlvr.rollout.vllm import VLLMEngine
from lit_rlvr.rollout.vllm_server import VLLMServerEngine

ROOT = Path(__file__).resolve().parents[1]
ENGINES = (RolloutEngine, HFEngine, HFProcessEngine, SGLangEngine, VLLMEngine, VLLMServerEngine, SGLangServerEngine)


def documented() -> tuple[set[str], dict[str, set[str]]]:
    """(the contract's member names, {engine class name: its own public members}) from §7's table."""
    text = (ROOT / "docs/architecture.md").read_text()
    section = text[text.index("## §7"):text.index("## §8")]
    common: set[str] = set()
    own: dict[str, set[str]] = {}
    for row in re.findall(r"^\| (`.+?) \| ([\w ]+) \|", section, flags=re.M):
        for name in re.findall(r"`([\w.]+)", row[0]):
            owner, _, member = name.rpartition(".")
            (own.setdefault(owner, set()) if owner else common).add(member)
    return common, own


def public_members(cls: type) -> set[str]:
    """Public names on the class (and its bases but `object`) and public attributes its methods assign."""
    names = {n for n in dir(cls) if not n.startswith("_")}
    for klass in cls.__mro__[:-1]:
        for node in ast.walk(ast.parse(inspect.getsource(klass))):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for target in targets:
                for leaf in ast.walk(target) if target is not None else ():
                    if (isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name)
                            and leaf.value.id == "self" and not leaf.attr.startswith("_")):
                        names.add(leaf.attr)
    return names


def test_the_table_lists_the_contract():
    common, own = documented()
    assert {"generate", "load_weights", "end_weight_update", "load_adapter", "sleep", "wake", "shutdown",
            "holds_weights", "shares_weights", "max_lora_rank"} <= common
    assert own == {"VLLMEngine": {"engine_pids", "worker_pids"}, "HFProcessEngine": {"engine_pids"}}


@pytest.mark.parametrize("cls", ENGINES, ids=lambda c: c.__name__)
def test_every_engine_has_the_documented_members_and_no_other_public_one(cls):
    common, own = documented()
    assert sorted(n for n in common | own.get(cls.__name__, set()) if not hasattr(cls, n)) == []
    assert sorted(public_members(cls) - common - own.get(cls.__name__, set())) == []


def test_no_engine_keeps_the_trainers_weight_bookkeeping():
    """Which weights an engine holds (version, mean or sample, adapter names) is `WeightSync`'s, not the engine's."""
    for cls in ENGINES:
        assert not public_members(cls) & {"version", "holds_base", "active_adapter", "mode", "dtype"}, cls.__name__
