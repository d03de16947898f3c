"""The supervisors: one run, a fleet, recovery, finishing (docs/design.md, "Supervisors")."""
