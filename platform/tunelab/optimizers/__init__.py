"""Optimizers tunelab implements itself (see docs/optimizers.md for where each registry name comes from).
torch only: the planner imports them to read their constructors' signatures.

May import: core, folders.
"""

from tunelab.optimizers.adalomo import AdaLomo
from tunelab.optimizers.adan import Adan
from tunelab.optimizers.lion import Lion
from tunelab.optimizers.lomo import Lomo
from tunelab.optimizers.muon import MuonAdamW
from tunelab.optimizers.sophia import SophiaG

__all__ = ["AdaLomo", "Adan", "Lion", "Lomo", "MuonAdamW", "SophiaG"]
