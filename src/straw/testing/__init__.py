"""Test support shipped with straw: the seeded fault-injecting filesystem for simulation.

``FaultFS`` is an in-memory implementation of ``straw._fs.system.System`` that models
power loss (docs/DURABILITY.md, "Simulation"); install it with
``straw._fs.system.installed(FaultFS(seed))``.
"""

from .faultfs import FaultFS, SimulatedPowerLoss, SimulationDeadlock

__all__ = ["FaultFS", "SimulatedPowerLoss", "SimulationDeadlock"]
