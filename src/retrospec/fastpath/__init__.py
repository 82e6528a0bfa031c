"""The engine's fast paths on the running machine: prepacked linears, measured head layout, prefix + block
attention, on a private copy of the model (``engine``), chosen by measurement and cached (``plan``)."""

from .engine import EngineModel, engine_for
from .plan import Plan, device_clock, machine_id

__all__ = ["EngineModel", "engine_for", "Plan", "device_clock", "machine_id"]
