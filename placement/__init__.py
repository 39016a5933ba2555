"""Neuron placement (PowerInfer section 6): which FFN neurons live on the GPU, by an ILP on OR-Tools."""

from placement.budget import HARDWARE, Budget, Hardware, load_hardware, plan_budget
from placement.solver import Placement, greedy, load_placement, save_placement, solve

__all__ = ["HARDWARE", "Budget", "Hardware", "load_hardware", "plan_budget", "Placement", "greedy", "load_placement",
           "save_placement", "solve"]
