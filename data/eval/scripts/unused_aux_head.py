"""A model with an auxiliary head that the training loss never uses."""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.head = nn.Linear(32, 4)
        self.aux_head = nn.Linear(32, 4)

    def forward(self, x):
        features = self.backbone(x)
        return self.head(features)


def main():
    dist.init_process_group("gloo")
    model = DDP(Classifier())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(3):
        logits = model(torch.randn(8, 16))
        loss = nn.functional.cross_entropy(logits, torch.randint(0, 4, (8,)))
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
