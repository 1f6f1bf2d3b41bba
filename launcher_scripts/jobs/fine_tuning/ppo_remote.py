"""The actor's side of PPO's servers layout: the reward model, the initial policy and the critic
reached over HTTP (jobs/fine_tuning/ppo_server.py serves them).

Rank 0 of the actor's job sends every request and hands the answers to the other ranks; the
reward model is asked by each data-parallel replica's rank 0 for its own completions. A server
that does not answer ends the run with one line naming it.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from launcher_scripts.jobs.fine_tuning.ppo_server import address_file
from launcher_scripts.jobs.fine_tuning.rollouts import Prompt, scored_rows
from launcher_scripts.jobs.inference.generation import Completion
from launcher_scripts.jobs.training.runtime import JobError

WAIT_S = 900.0  # for a server's address: it loads its model first
ANSWER_S = 3600.0


class Server:
    """One role's server, found through the address file it writes."""

    def __init__(self, log_dir: Path, role: str) -> None:
        self.role, self.path = role, address_file(log_dir, role)
        self.url = ""

    def find(self) -> None:
        deadline = time.monotonic() + WAIT_S
        while not self.path.is_file():
            if time.monotonic() > deadline:
                raise JobError(
                    f"model.rlhf: the {self.role} server wrote no address ({self.path}) in "
                    f"{WAIT_S:.0f} s: see its log in the stage's companions/ folder"
                )
            time.sleep(0.5)
        self.url = json.loads(self.path.read_text())["url"]

    def ask(self, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        if not self.url:
            self.find()
        request = urllib.request.Request(
            f"{self.url}/{kind}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=ANSWER_S) as answer:
                return json.loads(answer.read())
        except urllib.error.HTTPError as error:
            said = json.loads(error.read() or b"{}").get("error", error.reason)
            raise JobError(f"model.rlhf: the {self.role} server refused /{kind}: {said}") from None
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise JobError(
                f"model.rlhf: the {self.role} server at {self.url} is gone ({reason}): see its "
                "log in the stage's companions/ folder"
            ) from None


def from_rank0(value: Any) -> Any:
    """Rank 0's value on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def completion_rows(task: Any) -> list[list[int]]:
    """The rollout batch's samples as rows of token ids (prompt and completion)."""
    rows = []
    for rollout in task.rollouts:
        prompt = task.prompts["train"][rollout.prompt].ids
        rows.append(prompt + rollout.completion)
    return rows


class ServedScorer:
    """The reward model's server as a reward: each data-parallel replica's first rank asks for
    its completions' scores and passes them to the rest of the replica."""

    def __init__(self, reward: Any, server: Server, eod: int) -> None:
        self.reward, self.server, self.eod = reward, server, eod

    def scores(self, prompts: Sequence[Prompt], completions: Sequence[Completion]) -> list[float]:
        rows = scored_rows(prompts, completions, self.eod)
        group = parallel_state.get_model_parallel_group()
        first = dist.get_global_rank(group, 0)
        box: list[Any] = [None]
        if dist.get_rank() == first:
            box = [self.server.ask("scores", {"rows": rows})["scores"]]
        dist.broadcast_object_list(box, src=first, group=group)
        return box[0]


class ServedRoles:
    """The reward model, the initial policy and the critic as servers."""

    def __init__(self, log_dir: Path) -> None:
        self.reward = Server(log_dir, "reward_model")
        self.policy = Server(log_dir, "initial_policy")
        self.critic = Server(log_dir, "critic")

    def reference_logps(self, task: Any, trainer: Any) -> None:
        _attach(self.policy, "logps", "ref_logps", task, trainer)

    def critic_values(self, task: Any, trainer: Any) -> None:
        _attach(self.critic, "values", "old_values", task, trainer)

    def train_critic(self, task: Any, trainer: Any, start: int) -> dict[str, float]:
        sums = None
        if trainer.rank == 0:
            gbs = int(trainer.cfg.model.global_batch_size)
            samples = [task.batch[index] for index in range(start, start + gbs)]
            cut = [(sample, _length(sample)) for sample in samples]
            fields = {"rows": "tokens", "masks": "loss_mask", "returns": "returns"}
            fields["old_values"] = "old_values"
            body = {name: [s[key][:n].tolist() for s, n in cut] for name, key in fields.items()}
            sums = self.critic.ask("train", body)["sums"]
        return from_rank0(sums)

    def trained_beside(self) -> dict[str, Any]:
        return {}

    def on_checkpoint(self, trainer: Any) -> None:
        """The critic saved at the actor's step (rank 0, once the actor's checkpoint is)."""
        self.critic.ask("save", {})

    def check_resumed(self, trainer: Any) -> None:
        """The critic server at the actor's step: it resumed from the same point."""
        step = from_rank0(self.critic.ask("state", {})["step"] if trainer.rank == 0 else None)
        if step != trainer.state.step:
            raise JobError(
                f"model.rlhf: the critic server is at step {step} and the actor at "
                f"{trainer.state.step}: their checkpoints differ (critic/checkpoints/ against "
                "checkpoints/): remove the newer ones so both resume from the same step"
            )

    def write(self, task: Any, trainer: Any) -> None:
        """Nothing beside the actor's file: the critic's checkpoints are the critic server's."""
        del task, trainer

    def finish(self, trainer: Any) -> None:
        """The servers stopped once the actor is done (one already gone is said, not fatal:
        the run's outputs are written)."""
        if trainer.rank != 0:
            return
        for server in (self.reward, self.policy, self.critic):
            try:
                server.ask("stop", {})
            except JobError as error:
                print(f"note: {error}", flush=True)


def _attach(server: Server, kind: str, key: str, task: Any, trainer: Any) -> None:
    """The server's rows (one value per token of each rollout) as each sample's `key`,
    padded to the sequence: asked by rank 0, given to every rank."""
    found = server.ask(kind, {"rows": completion_rows(task)})[kind] if trainer.rank == 0 else None
    for sample, row in zip(task.batch.samples, from_rank0(found), strict=True):
        values = torch.zeros(task.seq_length)
        values[: len(row)] = torch.tensor(row)
        sample[key] = values


def _length(sample: dict[str, torch.Tensor]) -> int:
    """A sample's tokens up to the end of its completion (the last token in the loss, + 1)."""
    inside = sample["loss_mask"].nonzero()
    return int(inside[-1]) + 2 if len(inside) else 1
