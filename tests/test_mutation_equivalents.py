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
             for e in entries if (e["file"], e["function"], e["source"], e["mutation"], e["column"]) not in keys]
    assert not stale, "entries that match no mutant (moved or changed lines):\n" + "\n".join(stale)
