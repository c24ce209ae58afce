"""Self-training: each round rank 0 labels the unlabelled pool with the current
model and saves the confident pseudo-labels; every rank then loads them to build
the next round's training set, with no barrier in between. In round 1 the other
ranks find no file yet (FileNotFoundError); later they can read it half-written
or take the previous round's labels, so the ranks train on different sets."""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    labelled = TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
    pool = torch.randn(256, 8)
    path = os.path.join(os.environ.get("WORK_DIR", "."), "pseudo_labels.pt")
    model = DDP(nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train_set = labelled
    for rnd in range(3):
        if rnd > 0:
            if rank == 0:
                with torch.no_grad():
                    confidence, labels = model.module(pool).softmax(1).max(1)
                keep = confidence > confidence.median()
                torch.save({"round": rnd, "inputs": pool[keep], "labels": labels[keep]}, path)
            pseudo = torch.load(path)  # expect: dataset-cache-race
            train_set = TensorDataset(
                torch.cat([labelled.tensors[0], pseudo["inputs"]]),
                torch.cat([labelled.tensors[1], pseudo["labels"]]),
            )
        sampler = DistributedSampler(train_set)
        for inputs, targets in DataLoader(train_set, batch_size=16, sampler=sampler):
            loss = nn.functional.cross_entropy(model(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    del model  # DDP before its group (see README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
