"""The supervisors: one run, a fleet of runs, recovery and finishing (docs/design.md, "Supervisors")."""
