"""Stage modules register themselves in `STAGES` when imported here."""

from launcher_scripts.stages import (  # noqa: F401
    conversion,
    data_curation,
    data_preparation,
    evaluation,
    export,
    fine_tuning,
    training,
)
from launcher_scripts.stages.base import STAGES, Stage, StageContext

__all__ = ["STAGES", "Stage", "StageContext"]
