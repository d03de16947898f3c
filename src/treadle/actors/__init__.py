"""The five actors of a run (docs/design.md, "The five actors")."""
