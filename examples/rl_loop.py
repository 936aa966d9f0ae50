"""rl_loop: generators sample with the current policy, a learner trains, weights flow back.

A toy reinforcement-learning loop in the shape of RL post-training. The policy maps a
context token to a distribution over ``VOCAB`` answer tokens; the reward is 1 when the
answer is the hidden target for that context (``(3 * context + 1) % VOCAB``), else 0.
An untrained policy earns about ``1 / VOCAB``.

Each round:

1. the generator actors (``--generators`` processes) sample answers with the policy
   weights they hold and score them, reporting the weight version they used;
2. the learner actor (its own process) takes one policy-gradient step (REINFORCE with
   a mean baseline) on all the samples;
3. the learner sends its new weights (a state_dict of tensors) straight to the
   generators through their ActorMesh, with the new version number, before it
   answers the controller.

The controller prints the mean reward per round, which rises, and the weight version
the generators report. Run it with ``python examples/rl_loop.py`` (``--rounds 12`` by
default; ``--trio`` for the trio backend).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import amesh
from amesh import ActorMesh, ProcMesh, current_rank, endpoint

VOCAB = 8


@dataclass
class Samples:
    """Scored samples from one generator, and the weight version that made them."""

    contexts: torch.Tensor
    answers: torch.Tensor
    rewards: torch.Tensor
    version: int


def policy_net() -> nn.Module:
    """Context token -> logits over the answer tokens."""
    return nn.Sequential(nn.Embedding(VOCAB, 32), nn.Tanh(), nn.Linear(32, VOCAB))


def target(context: torch.Tensor) -> torch.Tensor:
    """The answer that earns a reward, per context token."""
    return (3 * context + 1) % VOCAB


class Generator(amesh.Actor):
    """Samples answers with its copy of the policy, at a known weight version."""

    def __init__(self, seed: int) -> None:
        torch.set_num_threads(1)
        torch.manual_seed(seed)
        self.policy = policy_net()
        self.version = 0
        self.gen = torch.Generator().manual_seed(seed * 1000 + current_rank().rank)

    @endpoint
    def generate(self, n: int) -> Samples:
        """``n`` scored samples: contexts, answers, rewards, and the weight version."""
        contexts = torch.randint(0, VOCAB, (n,), generator=self.gen)
        with torch.no_grad():
            probs = F.softmax(self.policy(contexts), dim=-1)
        answers = torch.multinomial(probs, 1, generator=self.gen).squeeze(1)
        rewards = (answers == target(contexts)).float()
        return Samples(contexts, answers, rewards, self.version)

    @endpoint
    def set_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Load the learner's weights; later samples report ``version``."""
        self.policy.load_state_dict(state)
        self.version = version

    @endpoint
    def weight_version(self) -> int:
        return self.version


class Learner(amesh.Actor):
    """Trains the policy on the generators' samples and pushes weights back to them."""

    def __init__(self, seed: int, lr: float, generators: ActorMesh[Generator]) -> None:
        torch.set_num_threads(1)
        torch.manual_seed(seed)  # the same initial weights as the generators
        self.policy = policy_net()
        self.opt = torch.optim.Adam(self.policy.parameters(), lr=lr)
        self.generators = generators
        self.version = 0

    @endpoint
    async def learn(self, batches: list[Samples]) -> int:
        """One policy-gradient step on ``batches``; returns the new weight version.

        The new weights reach every generator before this returns.
        """
        contexts = torch.cat([b.contexts for b in batches])
        answers = torch.cat([b.answers for b in batches])
        rewards = torch.cat([b.rewards for b in batches])
        logp = F.log_softmax(self.policy(contexts), dim=-1)
        chosen = logp.gather(1, answers.unsqueeze(1)).squeeze(1)
        loss = -((rewards - rewards.mean()) * chosen).mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        self.version += 1
        state = {k: v.detach().clone() for k, v in self.policy.state_dict().items()}
        # a call to every generator: tensors of 1 MiB or more are written once into
        # shared memory that the generators of this host all map (not once per rank)
        await self.generators.set_weights.call(state, self.version)
        return self.version


async def main(args: argparse.Namespace) -> None:
    env = {"OMP_NUM_THREADS": "1"}
    async with ProcMesh(per_host={"procs": 1 + args.generators}, env=env) as procs:
        generators = await procs.slice(procs=slice(1, None)).spawn(
            "generators", Generator, args.seed
        )
        learner = await procs.slice(procs=0).spawn(
            "learner", Learner, args.seed, args.lr, generators
        )
        print(f"1 learner and {len(generators)} generators, {VOCAB} possible answers")
        rewards: list[float] = []
        for rnd in range(1, args.rounds + 1):
            batches = (await generators.generate.call(args.samples)).values()
            reward = float(torch.cat([b.rewards for b in batches]).mean())
            used = sorted({b.version for b in batches})
            version = await learner.learn.call_one(batches)
            rewards.append(reward)
            print(
                f"round {rnd:2d}: reward {reward:.3f} (sampled with weight version "
                f"{', '.join(map(str, used))}); learner published version {version}"
            )
        versions = (await generators.weight_version.call()).values()
        print(f"first reward: {rewards[0]:.3f}")
        print(f"last reward: {rewards[-1]:.3f}")
        print(f"generators report weight version {', '.join(map(str, sorted(set(versions))))}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=12, help="generate/learn rounds")
    p.add_argument("--generators", type=int, default=2, help="generator processes")
    p.add_argument("--samples", type=int, default=256, help="samples per generator per round")
    p.add_argument("--lr", type=float, default=0.05, help="learner's Adam learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trio", action="store_true", help="run the controller on trio")
    return p.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    amesh.run(main, arguments, backend="trio" if arguments.trio else None)
