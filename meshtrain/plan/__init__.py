"""Knowing a job before it runs: measured communication (`meshtrain bench comm`), simulated
worlds, per-rank memory and step-time estimates, and the planner (`meshtrain plan`)."""
