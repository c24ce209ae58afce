"""An actor and its critic in one DDP module: the critic's update calls forward
with mode="value", which returns before the policy head, under a DDP that
expects a gradient for every parameter each step.

Runs under torchrun: the second update raises "Expected to have finished
reduction in the prior iteration".
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class ActorCritic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.policy = nn.Linear(16, 4)
        self.value = nn.Linear(16, 1)

    def forward(self, obs: torch.Tensor, mode: str = "both"):
        hidden = torch.tanh(self.body(obs))
        if mode == "value":
            return self.value(hidden)
        return self.policy(hidden), self.value(hidden)


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(ActorCritic())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(4):
        obs, returns = torch.randn(8, 8), torch.randn(8, 1)
        value_loss = (model(obs, mode="value") - returns).pow(2).mean()  # expect: unused-parameters
        optimizer.zero_grad()
        value_loss.backward()
        optimizer.step()
        logits, value = model(obs)
        advantage = (returns - value).detach()
        policy_loss = -(logits.log_softmax(-1)[:, 0:1] * advantage).mean()
        loss = policy_loss + 0.5 * (value - returns).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print("trained", flush=True)
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
