"""A DDP trainer whose OneCycleLR length is the whole dataset's step count, as
on one GPU. Each of the two ranks reads half the data through its
DistributedSampler, so the epochs end half way through the schedule: the
learning rate never anneals, and nothing fails. Its peak learning rate
follows the linear scaling rule (base lr x batch / 256) with the batch of one
process, while each DDP step averages the batches of both. Runs on CPU ranks
(gloo) and prints how much of the schedule the run used, and for how many
samples a step the learning rate was scaled against how many a step takes."""

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--base-lr", type=float, default=0.4)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    train_set = TensorDataset(torch.randn(128, 4), torch.randn(128, 1))
    sampler = DistributedSampler(train_set)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    model = DDP(nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    peak_lr = args.base_lr * args.batch_size / 256  # expect: effective-batch-size-changed
    total_steps = len(train_set) // args.batch_size * args.epochs
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=peak_lr, total_steps=total_steps)  # expect: effective-batch-size-changed
    steps = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in train_loader:
            if steps == 0:  # the samples one step averages over, on all ranks
                samples = torch.tensor(len(x))
                dist.all_reduce(samples)
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            steps += 1
    print(f"rank {dist.get_rank()} used {100 * steps // total_steps}% of the schedule")
    scaled_for = round(peak_lr / args.base_lr * 256)
    print(f"rank {dist.get_rank()} scaled the lr for {scaled_for} samples a step; a step takes {int(samples)}")
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
