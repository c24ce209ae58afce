"""A model that computes its own loss in forward, run through nn.DataParallel:
each replica's scalar is gathered into a vector, and backward() fails with
"grad can be implicitly created only for scalar outputs"."""

import torch
import torch.nn.functional as F
from torch import nn


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(16, 1)

    def forward(self, x, target=None):
        pred = self.net(x)
        if target is None:
            return pred
        return F.mse_loss(pred, target)


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(16, 4)
        self.criterion = nn.CrossEntropyLoss()

    def forward(self, x, y):
        loss = self.criterion(self.net(x), y)
        return loss


def main():
    model = nn.DataParallel(Regressor().cuda())
    classifier = Classifier().cuda()
    classifier = nn.DataParallel(classifier)
    optimizer = torch.optim.SGD([*model.parameters(), *classifier.parameters()], lr=0.1)
    for _ in range(100):
        x = torch.randn(64, 16, device="cuda")
        loss = model(x, torch.randn(64, 1, device="cuda"))
        loss.backward()  # expect: dataparallel-unsafe-model
        classifier(x, torch.randint(0, 4, (64,), device="cuda")).backward()  # expect: dataparallel-unsafe-model
        optimizer.step()
        optimizer.zero_grad()


if __name__ == "__main__":
    main()
