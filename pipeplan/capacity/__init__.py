"""Capacity: sweeps over device counts for runs that do not exist yet (analytic profiles, layouts, plots)."""
