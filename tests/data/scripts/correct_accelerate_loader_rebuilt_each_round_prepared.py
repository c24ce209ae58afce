"""Active learning with Accelerate: the loader rebuilt each round over the newly
selected examples is prepared like the first one (each process its share); a
helper that returns a loader its caller prepares is no mistake either."""

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, Subset, TensorDataset


def scoring_loader(data):
    return DataLoader(data, batch_size=64, shuffle=True)


def main():
    accelerator = Accelerator()
    data = TensorDataset(torch.randn(1024, 16), torch.randint(0, 4, (1024,)))
    model = torch.nn.Linear(16, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seed_loader = DataLoader(Subset(data, range(128)), batch_size=32, shuffle=True)
    model, optimizer, seed_loader = accelerator.prepare(model, optimizer, seed_loader)
    for x, y in seed_loader:
        accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    pool_loader = accelerator.prepare(scoring_loader(data))
    for x, _ in pool_loader:
        model(x)
    for round_ in range(3):
        picked = torch.randperm(1024, generator=torch.Generator().manual_seed(round_))[:256]
        round_loader = accelerator.prepare(
            DataLoader(Subset(data, picked.tolist()), batch_size=32, shuffle=True)
        )
        for x, y in round_loader:
            accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()


if __name__ == "__main__":
    main()
