"""One process drives every GPU through nn.DataParallel: the model and each
batch start on cuda:0, from where the replicas are scattered. No rank, no
process group: "cuda:0" is the right device here."""

import torch
from torch import nn


def main():
    device = torch.device("cuda:0")
    model = nn.DataParallel(nn.Linear(16, 4)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(100):
        x = torch.randn(64, 16, device=device)
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


if __name__ == "__main__":
    main()
