"""The solver layer both searches share: a PuLP model, HiGHS (CBC as fallback), and one reading of their statuses.

Why one home: the chain MILP (``search.chain``) and the shape MILP (``search.shapes``) must agree on what a
time-out, an infeasible model and a cutoff mean, and on the bound each gives: the gap the planner proves is
computed from these.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Optional

import highspy
import pulp

from ..errors import InputError
from ..quiet import quiet_stdout

# A search whose proven gap is within this is reported optimal: HiGHS's default relative MIP gap, where it stops
# and calls a MILP optimal itself.
OPTIMAL_GAP = 1e-4


@dataclass(frozen=True)
class MilpOutcome:
    """How a solve ended: ``optimal``, ``feasible`` (a solution, not proven optimal), ``infeasible`` or ``timeout``
    (no solution), and a proven lower bound on the objective (inf when infeasible; the cutoff when nothing below it
    exists; 0 where the solver reports none, as CBC through PuLP does)."""
    status: str
    bound: float

    @property
    def solved(self) -> bool:
        return self.status in ("optimal", "feasible")


class MilpModel:
    """A minimising PuLP model; subclasses add their row families, then ``solve``."""

    def __init__(self, name: str):
        self.prob = pulp.LpProblem(name, pulp.LpMinimize)
        # PuLP >= 3.3 owns variables by the model (add_variable); older releases construct them directly.
        self.var = getattr(self.prob, "add_variable", None) or (
            lambda name, lowBound=None, upBound=None, cat="Continuous": pulp.LpVariable(name, lowBound, upBound, cat))

    @staticmethod
    def lin(terms) -> pulp.LpAffineExpression:
        """sum of coefficient x variable over (variable, coefficient) pairs."""
        return pulp.LpAffineExpression(terms)

    def solve(self, solver: str, time_limit_s: float, cutoff: Optional[float] = None) -> MilpOutcome:
        """Solve within ``time_limit_s``; ``cutoff``: only solutions below it are of interest (an incumbent)."""
        prob = self.prob
        with quiet_stdout():
            prob.solve(solver_for(solver, time_limit_s, cutoff))
        bound = 0.0
        if solver == "highs":
            info = prob.solverModel.getInfo()
            bound = float(info.mip_dual_bound) if math.isfinite(info.mip_dual_bound) else 0.0
        if prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
            # CBC through PuLP reports "Optimal" on a time-out with a merely feasible answer: sol_status tells them apart
            return MilpOutcome("optimal" if prob.sol_status == pulp.LpSolutionOptimal else "feasible", bound)
        if prob.status == pulp.LpStatusInfeasible or prob.sol_status == pulp.LpSolutionInfeasible:
            return MilpOutcome("infeasible", math.inf)
        if cutoff is not None and solver == "highs" and \
                prob.solverModel.getModelStatus() == highspy.HighsModelStatus.kObjectiveBound:
            return MilpOutcome("infeasible", float(cutoff))  # nothing better than the cutoff exists
        return MilpOutcome("timeout", bound)


def solver_for(solver: str, time_limit_s: float, cutoff: Optional[float]):
    """The PuLP solver command: HiGHS single-threaded without presolve (measured: presolve dominated the time on
    4k-candidate models, same optimum without it), or CBC."""
    if solver == "highs":
        extra = {"objective_bound": float(cutoff)} if cutoff is not None else {}
        return pulp.HiGHS(msg=False, timeLimit=max(0.2, time_limit_s), presolve="off", threads=1, **extra)
    if solver == "cbc":
        with warnings.catch_warnings():  # PuLP 3.3 deprecates its bundled CBC in favour of pulp[cbc]'s COIN_CMD
            warnings.simplefilter("ignore", DeprecationWarning)
            return pulp.PULP_CBC_CMD(msg=False, timeLimit=max(1, int(math.ceil(time_limit_s))), threads=1)
    raise InputError("--solver", f"unknown MILP solver {solver!r}")
