"""tests/scripts/packed_losses.py and tests/scripts/peft_frozen.py on one tuner, in one process
(each would otherwise pay a process's start-up and build the same tuner):

python -m tests.scripts.lora_checks STAGE_HYDRA.yaml STAGE STEPS COUNT
prints one JSON line: {"packed": packed_losses' report on COUNT samples, "frozen": peft_frozen's
report after STEPS steps}. The packed losses are computed first, without gradients, so the
training steps start from the weights the tuner was built with, as peft_frozen alone does.
"""

from __future__ import annotations

import json
import sys

from tests.scripts.packed_losses import packed_report
from tests.scripts.peft_frozen import frozen_report, parameters
from tests.scripts.tuner_setup import built_tuner


def main() -> None:
    config, stage, steps, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    with built_tuner(config, stage) as tuner:
        model = tuner.model[0].module
        training = model.training
        before = parameters(tuner)
        tuner.prepare_data()
        packed = packed_report(tuner, count)  # in eval mode, without gradients
        model.train(training)
        assert all(p.detach().equal(before[n]) for n, p in model.named_parameters())
        frozen = frozen_report(tuner, steps, before)
    print(json.dumps({"packed": packed, "frozen": frozen}))


if __name__ == "__main__":
    main()
