"""Edges that scripts/mutation.py found unchecked (docs/mutation.md): each test kills named mutants."""
