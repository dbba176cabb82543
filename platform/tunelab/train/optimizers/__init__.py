"""Optimizers tunelab implements itself (see docs/optimizers.md for where each registry name comes from)."""

from tunelab.train.optimizers.adalomo import AdaLomo
from tunelab.train.optimizers.adan import Adan
from tunelab.train.optimizers.lion import Lion
from tunelab.train.optimizers.lomo import Lomo
from tunelab.train.optimizers.muon import MuonAdamW
from tunelab.train.optimizers.sophia import SophiaG

__all__ = ["AdaLomo", "Adan", "Lion", "Lomo", "MuonAdamW", "SophiaG"]
