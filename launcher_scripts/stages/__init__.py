"""Stage modules register themselves in `STAGES` when imported here."""

from launcher_scripts.stages import conversion, data_preparation, training  # noqa: F401
from launcher_scripts.stages.base import STAGES, Stage, StageContext

__all__ = ["STAGES", "Stage", "StageContext"]
