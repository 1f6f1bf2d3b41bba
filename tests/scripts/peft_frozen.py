"""Train a tuning stage's model a few steps in this process and report which tensors changed:

python -m tests.scripts.peft_frozen STAGE_HYDRA.yaml STAGE STEPS
prints one JSON line: counts of base and PEFT tensors, and the names of those that changed.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from omegaconf import OmegaConf


def main() -> None:
    config, stage, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    from launcher_scripts.jobs.training import cpu_compat, runtime

    cpu_compat.patch_cuda_queries()
    cpu_compat.CudaDevicesOnCpu().__enter__()
    from launcher_scripts.jobs.conversion import portable
    from launcher_scripts.jobs.fine_tuning.finetune import training_cfg
    from launcher_scripts.jobs.fine_tuning.peft import is_peft_parameter
    from launcher_scripts.jobs.fine_tuning.tuner import FineTuner
    from launcher_scripts.jobs.fine_tuning.tuning import read_spec
    from launcher_scripts.jobs.training.pretrain import StopSignals
    from launcher_scripts.ports import free_port

    recipe = OmegaConf.load(config)
    with tempfile.TemporaryDirectory() as scratch:
        recipe.exp_manager.explicit_log_dir = str(Path(scratch) / "log")
        spec = read_spec(recipe, stage)
        base = portable.read(spec.base_model, Path(scratch))
        cfg = training_cfg(recipe, spec, base.config)
        os.environ["MASTER_PORT"] = str(free_port("127.0.0.1"))
        runtime.init_distributed(runtime.process_info(), False, 60)
        tuner = FineTuner(cfg, spec, base, False, StopSignals())
        model = tuner.model[0].module
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        tuner._build_data()
        for _ in range(steps):
            tuner.train_step()
        changed = [n for n, p in model.named_parameters() if not p.detach().equal(before[n])]
        keys = {n: is_peft_parameter(n) for n in before}
        runtime.shutdown()
    base_names = [n for n, peft in keys.items() if not peft]
    peft_names = [n for n, peft in keys.items() if peft]
    report = {
        "base_tensors": len(base_names),
        "peft_tensors": len(peft_names),
        "base_changed": [n for n in changed if n in base_names],
        "peft_changed": len([n for n in changed if n in peft_names]),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
