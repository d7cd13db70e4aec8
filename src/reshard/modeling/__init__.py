"""Modeling: machines and where ranks run, the cost model and lower bound, pictures; pure numpy."""
