"""Neuron placement (the PowerInfer paper, section 6): which FFN neurons live on the GPU, by an ILP on OR-Tools, and
llama.cpp's whole-layer offload as the baseline policy. Decides; `fast.hybrid` applies what it decides."""

from placement.budget import HARDWARE, Budget, Hardware, hardware_for, load_hardware, plan_budget, whole_layers
from placement.place import place, request
from placement.solver import Placement, greedy, solve

__all__ = ["HARDWARE", "Budget", "Hardware", "hardware_for", "load_hardware", "plan_budget", "whole_layers", "place",
           "request", "Placement", "greedy", "solve"]
