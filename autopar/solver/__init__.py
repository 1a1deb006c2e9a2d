"""Choosing strategies: the optimisation problem (`problem.py`) and its ILP (`ilp.py`)."""
