"""Active learning with Accelerate: the first loader is prepared, but the loader
rebuilt each round over the newly selected examples is trained on without
prepare(), so every process iterates all of it."""

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, Subset, TensorDataset


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
    for round_ in range(3):
        picked = torch.randperm(1024, generator=torch.Generator().manual_seed(round_))[:256]
        round_loader = DataLoader(Subset(data, picked.tolist()), batch_size=32, shuffle=True)  # expect: missing-distributed-sampler
        for x, y in round_loader:
            x, y = x.to(accelerator.device), y.to(accelerator.device)
            accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()


if __name__ == "__main__":
    main()
