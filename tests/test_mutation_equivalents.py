"""scripts/mutation_equivalents.toml names mutants the code has: an entry left behind when its line moved or changed
would excuse nothing and hide that the new line's mutant needs a test (or an entry of its own)."""

import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from mutants import list_mutants  # noqa: E402


def test_every_equivalent_entry_names_a_mutant_of_the_current_code():
    entries = tomllib.loads((REPO / "scripts" / "mutation_equivalents.toml").read_text())["equivalent"]
    files = {e["file"] for e in entries}
    keys = {m.key for f in files for m in list_mutants(REPO / f)}
    stale = [f"{e['file']} {e['function']}: {e['mutation']} at column {e['column']} in `{e['source']}`"
             for e in entries if (e["file"], e["function"], e["source"], e["mutation"], e["column"],
                                  *([e["repeat"]] if e.get("repeat") else [])) not in keys]
    assert not stale, "entries that match no mutant (moved or changed lines):\n" + "\n".join(stale)


def test_an_identical_line_twice_in_a_function_gives_mutants_of_their_own():
    """Two equal lines of one function (the reward runner's two waits under a deadline) are two sets of mutants:
    a kill on one must not count for the other when a run is resumed."""
    mutants = [m for m in list_mutants(REPO / "lit_rlvr" / "rewards" / "base.py")
               if m.function == "RewardRunner._side_by_side" and "deadline - time.monotonic()" in m.source]
    lines = sorted({m.line for m in mutants})
    assert len(lines) == 2
    assert len({m.key for m in mutants}) == len(mutants)
    assert {m.repeat for m in mutants if m.line == lines[1]} == {1}
