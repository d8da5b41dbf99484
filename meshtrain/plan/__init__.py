"""Knowing a job before it runs: measured communication (`meshtrain bench comm`), and next the
estimates, simulated worlds and planner that read it."""
