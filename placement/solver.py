"""PowerInfer's neuron-placement ILP (paper section 6.3), over groups of neurons, on OR-Tools CP-SAT.

Per layer l, neurons sorted by firing count (most frequent first) and cut into groups g of `group` neurons:
    maximise   sum_{l,g,d} c_{l,g} x_{l,g,d}                 c: summed firing counts of the group
    subject to sum_{l,g} s_{l,g} x_{l,g,d} * neuron_bytes <= ffn_budget_d     (each GPU d's memory)
               x_{l,g} = sum_d x_{l,g,d} <= 1                              (a group on one GPU at most)
               F_l - sum_g s_{l,g} x_{l,g} <= F_l y_l                          (y_l = 1 if the layer has CPU neurons)
               F_l - sum_g s_{l,g} x_{l,g} >= C_l y_l                          (... and then at least C_l of them)
               x_{l,g} >= x_{l,g+1} for full-size groups g, g+1              (symmetry: a more frequent group first;
                                                                              an exchange never loses objective)
               GPUs of one size: the first holds no fewer neurons than the next (they are interchangeable)
With one GPU this is the paper's ILP; several GPUs each get a capacity constraint (the engine runs one).
Dimensions: L layers, F FFN neurons, G groups per layer, d GPUs.
"""

import time
from dataclasses import dataclass

import numpy as np

from ref.common.errors import UserError


@dataclass
class Groups:
    """Neurons of every layer in frequency order, cut into groups."""

    order: list  # per layer: neuron ids [F] sorted by count, descending (stable)
    sizes: list  # per layer: group sizes [G]
    weights: list  # per layer: summed counts per group [G] (int)

    @staticmethod
    def build(counts: np.ndarray, group: int) -> "Groups":
        if group < 1:
            raise UserError(f"--group must be >= 1, got {group}")
        order, sizes, weights = [], [], []
        for c in counts:
            o = np.argsort(-c, kind="stable")
            starts = np.arange(0, len(c), group)
            order.append(o)
            sizes.append(np.minimum(group, len(c) - starts))
            weights.append(np.add.reduceat(c[o].astype(np.int64), starts) if len(c) else np.zeros(0, np.int64))
        return Groups(order, sizes, weights)

    def neurons(self, l: int, taken) -> np.ndarray:
        """Sorted int32 neuron ids of the taken groups of layer l."""
        starts = np.concatenate([[0], np.cumsum(self.sizes[l])])
        ids = [self.order[l][starts[g]:starts[g + 1]] for g in range(len(self.sizes[l])) if taken[g]]
        return np.sort(np.concatenate(ids)).astype(np.int32) if ids else np.empty(0, np.int32)


@dataclass
class Placement:
    gpu_neurons: list  # per layer: sorted int32 neuron ids on a GPU (any of them)
    status: str
    objective: float  # summed firing counts covered by the GPUs
    bound: float
    solve_seconds: float
    min_cpu_neurons: list
    device_neurons: list = None  # per GPU, per layer: its sorted int32 neuron ids (one GPU: [gpu_neurons])

    @property
    def gap(self) -> float:
        return (self.bound - self.objective) / max(abs(self.bound), 1e-12)

    def report(self) -> dict:
        """What the placement file records of the solve."""
        return {"status": self.status, "objective": self.objective, "bound": self.bound, "gap": self.gap,
                "solve_seconds": self.solve_seconds, "min_cpu_neurons": self.min_cpu_neurons}


def greedy(groups: Groups, capacities: list[int]) -> list[np.ndarray]:
    """Global top-k: groups by count, most first, each to the GPU with the most room left (`capacities` in neurons)
    while one has room. Optimal for one GPU when C_l = 0 and all groups have one size. Per layer: each group's GPU,
    -1 for the CPU."""
    cand = sorted(((-w, l, g) for l, ws in enumerate(groups.weights) for g, w in enumerate(ws)))
    where = [np.full(len(s), -1) for s in groups.sizes]
    left = list(capacities)
    for _, l, g in cand:
        d = int(np.argmax(left))
        if groups.sizes[l][g] <= left[d]:
            where[l][g] = d
            left[d] -= groups.sizes[l][g]
    return where


def repair(groups: Groups, where: list[np.ndarray], min_cpu: list[int]) -> list[np.ndarray]:
    """Make a selection feasible for the communication constraint by moving a layer's least frequent GPU groups to
    the CPU until it keeps 0 or >= C_l CPU neurons there (moving frees memory, so the budgets still hold)."""
    out = [w.copy() for w in where]
    for l, w in enumerate(out):
        F = int(groups.sizes[l].sum())
        while 0 < F - int(groups.sizes[l][w >= 0].sum()) < min(min_cpu[l], F):
            w[np.flatnonzero(w >= 0)[-1]] = -1
    return out


def build_ilp(m, new_bool, weighted_sum, groups: Groups, capacities: list[int], min_cpu: list[int]) -> tuple[list, dict]:
    """Add the ILP to `m` (a CP-SAT CpModel or a pywraplp Solver: both take Add and Maximize), one capacity
    constraint per GPU (x_{l,g,d}: group g of layer l on GPU d, at most one d); returns x [l][g][d] and {l: y_l}."""
    n = len(capacities)
    x, y, on_device, obj_vars, obj_weights = [], {}, [([], []) for _ in capacities], [], []
    for l, (sizes, ws) in enumerate(zip(groups.sizes, groups.weights)):
        xl = [[new_bool(f"x{l}_{g}_{d}") for d in range(n)] for g in range(len(sizes))]
        on = [xg[0] if n == 1 else weighted_sum(xg, [1] * n) for xg in xl]  # group g on some GPU
        for g in range(len(sizes)):
            if n > 1:
                m.Add(on[g] <= 1)
            if g + 1 < len(sizes) and sizes[g] == sizes[g + 1]:
                m.Add(on[g] >= on[g + 1])
        if min_cpu[l] > 0:
            F = int(sizes.sum())
            on_gpu = weighted_sum([v for xg in xl for v in xg], [int(v) for v in sizes for _ in range(n)])
            y[l] = new_bool(f"y{l}")
            m.Add(F - on_gpu <= F * y[l])
            m.Add(F - on_gpu >= min(min_cpu[l], F) * y[l])
        for d in range(n):
            on_device[d][0].extend(xg[d] for xg in xl)
            on_device[d][1].extend(int(v) for v in sizes)
        x.append(xl)
        obj_vars += [v for xg in xl for v in xg]
        obj_weights += [int(w) for w in ws for _ in range(n)]
    for (vs, cs), cap in zip(on_device, capacities):
        m.Add(weighted_sum(vs, cs) <= cap)
    for d in range(n - 1):  # GPUs of one size are interchangeable: the first holds at least as much
        if capacities[d] == capacities[d + 1]:
            m.Add(weighted_sum(*on_device[d]) >= weighted_sum(*on_device[d + 1]))
    m.Maximize(weighted_sum(obj_vars, obj_weights))
    return x, y


def solve(counts: np.ndarray, neuron_bytes: int, ffn_budget_bytes, min_cpu: list[int], group: int = 64,
          time_limit: float = 10.0, workers: int = 2, backend: str = "cpsat") -> Placement:
    """The ILP above on CP-SAT (warm-started from the repaired greedy selection), or on SCIP for comparison;
    `ffn_budget_bytes` one GPU's FFN budget, or a list of one per GPU.

    Several GPUs on CP-SAT: the one-GPU ILP over the neurons the GPUs hold whatever the packing (each GPU's
    capacity less one group but a neuron), its groups then packed first-fit, a layer's spread over the GPUs (so that
    they share its work); optimal up to one group a GPU, the gap against the knapsack bound over all of their
    capacity reported. The joint ILP's symmetric GPUs left CP-SAT far from a proof at 70B (gap 0.25 after 10 s)."""
    t0 = time.perf_counter()
    groups = Groups.build(counts, group)
    budgets = list(ffn_budget_bytes) if np.ndim(ffn_budget_bytes) else [ffn_budget_bytes]
    capacities = [max(0, b) // neuron_bytes for b in budgets]  # neurons that fit each GPU
    if backend == "scip":
        return solve_scip(groups, capacities, min_cpu, time_limit, t0)
    if len(capacities) == 1:
        on, status, objective, bound = solve_cpsat(groups, capacities, min_cpu, time_limit, workers)
        return placement(groups, on, status, objective, bound, t0, min_cpu)
    big = max((int(s.max()) for s in groups.sizes if len(s)), default=1)
    on, _, objective, _ = solve_cpsat(groups, [sum(max(0, c - big + 1) for c in capacities)], min_cpu, time_limit,
                                      workers)
    on = pack(groups, on, capacities)
    bound = knapsack_bound(groups, sum(capacities))
    return placement(groups, on, "OPTIMAL" if objective >= bound else "FEASIBLE", objective, bound, t0, min_cpu)


def solve_cpsat(groups: Groups, capacities: list[int], min_cpu: list[int], time_limit: float, workers: int):
    """x [l][g][d] (booleans), status, objective and bound of the ILP on CP-SAT, from the repaired greedy hint."""
    from ortools.sat.python import cp_model

    m = cp_model.CpModel()
    x, y = build_ilp(m, m.NewBoolVar, cp_model.LinearExpr.WeightedSum, groups, capacities, min_cpu)
    hint = repair(groups, greedy(groups, capacities), min_cpu)
    has_cpu = {l: int((hint[l][groups.sizes[l] > 0] < 0).any()) for l in y}
    m.Proto().solution_hint.vars.extend([v.Index() for xl in x for xg in xl for v in xg] + [v.Index() for v in y.values()])
    m.Proto().solution_hint.values.extend([int(h == d) for hl in hint for h in hl for d in range(len(capacities))]
                                          + list(has_cpu.values()))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit
    solver.parameters.num_workers = workers
    solver.parameters.relative_gap_limit = 1e-4  # below one unit of objective on small instances: exact there
    # Presolve costs seconds on 70B-sized models (measured 5.7 s with it, 1.8 s without) and buys nothing here:
    # the hint is near-optimal and the LP bound is tight.
    solver.parameters.cp_model_presolve = False
    status = solver.Solve(m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise UserError(f"placement: CP-SAT found no solution ({solver.StatusName(status)})")
    on = [[[solver.BooleanValue(v) for v in xg] for xg in xl] for xl in x]
    return on, solver.StatusName(status), solver.ObjectiveValue(), solver.BestObjectiveBound()


def pack(groups: Groups, on: list, capacities: list[int]) -> list:
    """The groups one GPU's solution takes (on [l][g][0]), each to the GPU with the most room left, layer by layer:
    it fits whenever any GPU has room for it, and some GPU always does while the groups total at most each capacity
    less one group but a neuron (else every GPU has less than a group free and the groups placed exceed that total)."""
    left, out = list(capacities), []
    for l, xl in enumerate(on):
        out.append([])
        for g, xg in enumerate(xl):
            d = int(np.argmax(left))
            out[-1].append([bool(xg[0]) and k == d for k in range(len(capacities))])
            left[d] -= groups.sizes[l][g] if xg[0] else 0
    assert min(left) >= 0
    return out


def knapsack_bound(groups: Groups, capacity: int) -> float:
    """An upper bound on any placement within `capacity` neurons: the densest groups first, the last one in part
    (the LP relaxation without the communication constraint)."""
    w = np.concatenate(groups.weights).astype(np.float64)
    s = np.concatenate(groups.sizes).astype(np.float64)
    order = np.argsort(-w / np.maximum(s, 1), kind="stable")
    taken = np.cumsum(s[order])
    full = np.searchsorted(taken, capacity, side="right")
    bound = w[order[:full]].sum()
    if full < len(order):
        bound += w[order[full]] * (capacity - (taken[full - 1] if full else 0)) / s[order[full]]
    return float(bound)


def placement(groups: Groups, on: list, status: str, objective: float, bound: float, t0: float, min_cpu) -> Placement:
    """The Placement of a solved x [l][g][d] (booleans)."""
    n = len(on[0][0]) if on and on[0] else 1
    device = [[groups.neurons(l, [bool(xg[d]) for xg in xl]) for l, xl in enumerate(on)] for d in range(n)]
    union = [groups.neurons(l, [any(xg) for xg in xl]) for l, xl in enumerate(on)]
    return Placement(union, status, objective, bound, time.perf_counter() - t0, list(min_cpu), device)


def solve_scip(groups: Groups, capacities: list[int], min_cpu: list[int], time_limit: float, t0: float) -> Placement:
    from ortools.linear_solver import pywraplp

    s = pywraplp.Solver.CreateSolver("SCIP")
    s.SetTimeLimit(int(time_limit * 1000))
    s.SetSolverSpecificParametersAsString("limits/gap = 1e-3\n")
    x, _ = build_ilp(s, s.BoolVar, lambda vs, cs: s.Sum([c * v for c, v in zip(cs, vs)]), groups, capacities, min_cpu)
    status = s.Solve()
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        raise UserError("placement: SCIP found no solution")
    on = [[[v.solution_value() > 0.5 for v in xg] for xg in xl] for xl in x]
    return placement(groups, on, "OPTIMAL" if status == pywraplp.Solver.OPTIMAL else "FEASIBLE",
                     s.Objective().Value(), s.Objective().BestBound(), t0, min_cpu)
