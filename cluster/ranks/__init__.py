"""Rank floor, beside the router and above the workers: a rank's host, its Ray actor, its node and its CPUs."""
