"""The PEFT file: a small tar holding only the tuned tensors and how to apply them.

    peft_config.yaml           method and settings, the data format (prompt template, virtual
                               tokens) and the base model it was tuned on
    peft_weights.safetensors   the added tensors in full (layout-independent), keyed `peft.*`

Also the collective that turns this rank's shards into full tensors on rank 0.
"""

from __future__ import annotations

import os
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from launcher_scripts.formats.portable import PEFT_CONFIG, add_bytes, readable
from launcher_scripts.tuning import PeftSettings

CONFIG = PEFT_CONFIG
WEIGHTS = "peft_weights.safetensors"


@dataclass
class PeftFile:
    settings: PeftSettings
    config: DictConfig  # the whole peft_config.yaml
    tensors: dict[str, torch.Tensor]


def write(
    path: Path, settings: PeftSettings, extra: dict[str, Any], tensors: dict[str, torch.Tensor]
) -> None:
    from safetensors.torch import save_file

    config = {"peft": settings.as_dict(), **extra}
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".peft-") as scratch:
        weights = Path(scratch) / WEIGHTS
        save_file({k: t.detach().contiguous().cpu() for k, t in tensors.items()}, str(weights))
        partial = Path(scratch) / path.name
        with tarfile.open(partial, "w") as tar:
            add_bytes(tar, CONFIG, OmegaConf.to_yaml(OmegaConf.create(config)).encode())
            tar.add(weights, arcname=WEIGHTS, filter=readable)
        os.replace(partial, path)


def is_peft_file(path: Path) -> bool:
    try:
        with tarfile.open(path) as tar:
            return CONFIG in tar.getnames()
    except (OSError, tarfile.TarError):
        return False


def read(path: Path) -> PeftFile:
    from safetensors.torch import load as load_safetensors

    with tarfile.open(path) as tar:
        names = tar.getnames()
        if CONFIG not in names or WEIGHTS not in names:
            raise ValueError(f"{path} is not a PEFT file (no {CONFIG} or {WEIGHTS})")
        config_member = tar.extractfile(CONFIG)
        weights_member = tar.extractfile(WEIGHTS)
        assert config_member is not None and weights_member is not None
        config = OmegaConf.create(config_member.read().decode())
        tensors = load_safetensors(weights_member.read())
    assert isinstance(config, DictConfig)
    settings = PeftSettings.from_dict(OmegaConf.to_container(config.peft, resolve=True))  # type: ignore[arg-type]
    return PeftFile(settings, config, tensors)


def gather_full(chunks: list[Any], wanted: Any) -> dict[str, torch.Tensor] | None:
    """Full tensors of the keys `wanted(key)` accepts, assembled on rank 0 (None elsewhere).

    Each shard is sent once, by its main replica, as a CPU object: meant for the small PEFT
    tensors, and for whole models only at the sizes a single host holds anyway.
    """
    from launcher_scripts.jobs.training.init_weights import model_tensors

    pieces = []
    for tensor in model_tensors(chunks):
        if not wanted(tensor.key):
            continue
        replica = tensor.replica_id
        main = all(r == 0 for r in replica) if isinstance(replica, tuple) else replica == 0
        if main:
            pieces.append(
                (
                    tensor.key,
                    tuple(tensor.global_shape),
                    tensor.global_slice(),
                    tensor.data.detach().float().cpu(),
                )
            )
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
    dist.gather_object(pieces, gathered if dist.get_rank() == 0 else None, dst=0)
    if dist.get_rank() != 0:
        return None
    full: dict[str, torch.Tensor] = {}
    for rank_pieces in gathered:
        for key, shape, index, local in rank_pieces:
            target = full.setdefault(key, torch.zeros(shape))
            target[index] = local.reshape(target[index].shape)
    return full
