"""Experience Replay (ER) with a reservoir buffer on Split CIFAR-100 (20 tasks).

Class-incremental, single expanding-output head (100 logits, masked to the
classes seen so far). Stream and replay samples are concatenated into one
forward pass. Logs to Weights & Biases.

    torchrun --nproc_per_node=8 06_er_reservoir_wandb.py --mem_size 5000 --wandb_project cl-er
"""
import argparse
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T


def get_args():
    parser = argparse.ArgumentParser("ER reservoir")
    parser.add_argument("--data_root", type=str, default="/scratch/datasets")
    parser.add_argument("--save_dir", type=str, default="./ckpt/er")
    parser.add_argument("--n_tasks", type=int, default=20)
    parser.add_argument("--epochs", type=int, default=1, help="1 = online / single pass")
    parser.add_argument("--batch_size", type=int, default=10, help="stream batch per GPU")
    parser.add_argument("--replay_batch_size", type=int, default=10, help="replay batch per GPU")
    parser.add_argument("--mem_size", type=int, default=5000, help="total over all GPUs")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--wandb_project", type=str, default="continual")
    parser.add_argument("--wandb_entity", type=str, default=None)
    parser.add_argument("--run_name", type=str, default=None)
    return parser.parse_args()


class ReservoirBuffer:
    def __init__(self, capacity, device):
        self.capacity = capacity
        self.x = torch.empty(capacity, 3, 32, 32, device=device)
        self.y = torch.empty(capacity, dtype=torch.long, device=device)
        self.n_seen = 0

    def __len__(self):
        return min(self.n_seen, self.capacity)

    def update(self, x, y):
        for xi, yi in zip(x, y):
            if self.n_seen < self.capacity:
                self.x[self.n_seen], self.y[self.n_seen] = xi, yi
            else:
                j = random.randint(0, self.n_seen)
                if j < self.capacity:
                    self.x[j], self.y[j] = xi, yi
            self.n_seen += 1

    def sample(self, n):
        idx = torch.randint(0, len(self), (min(n, len(self)),), device=self.x.device)
        return self.x[idx], self.y[idx]


def reduced_resnet18(n_classes):
    net = torchvision.models.resnet18(num_classes=n_classes)
    net.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    net.maxpool = nn.Identity()
    return net


@torch.no_grad()
def eval_tasks(net, test_set, targets, tasks, rank, world, device):
    """Per-task accuracy; every rank evaluates a strided slice, counts are summed."""
    net.eval()
    counts = torch.zeros(len(tasks), 2, device=device)
    seen = torch.tensor(sorted(c for cl in tasks for c in cl), device=device)
    for k, cl in enumerate(tasks):
        idx = np.where(np.isin(targets, cl))[0][rank::world]
        loader = DataLoader(Subset(test_set, idx.tolist()), batch_size=500, num_workers=2)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            logits = net(x)[:, seen]
            pred = seen[logits.argmax(1)]
            counts[k, 0] += (pred == y).sum()
            counts[k, 1] += y.numel()
    dist.all_reduce(counts)
    return (100.0 * counts[:, 0] / counts[:, 1]).tolist()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    wandb.init(project=args.wandb_project, entity=args.wandb_entity, name=args.run_name, config=vars(args))

    tf = T.Compose([T.ToTensor(), T.Normalize((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))])
    train_set = torchvision.datasets.CIFAR100(args.data_root, train=True, transform=tf)
    test_set = torchvision.datasets.CIFAR100(args.data_root, train=False, transform=tf)
    train_targets, test_targets = np.asarray(train_set.targets), np.asarray(test_set.targets)
    order = np.random.RandomState(args.seed).permutation(100)
    cpt = 100 // args.n_tasks
    tasks = [order[t * cpt:(t + 1) * cpt].tolist() for t in range(args.n_tasks)]

    net = reduced_resnet18(100).to(device)
    model = DDP(net, device_ids=[local_rank])
    # batch sizes are per GPU, so the single-GPU lr is scaled linearly with the number of ranks
    opt = torch.optim.SGD(model.parameters(), lr=args.lr * world)
    buffer = ReservoirBuffer(args.mem_size // world, device)
    acc = np.zeros((args.n_tasks, args.n_tasks))
    step = 0

    for t, classes in enumerate(tasks):
        seen_mask = torch.full((100,), float("-inf"), device=device)
        seen_mask[torch.tensor([c for cl in tasks[:t + 1] for c in cl], device=device)] = 0.0
        data = Subset(train_set, np.where(np.isin(train_targets, classes))[0].tolist())
        sampler = DistributedSampler(data, shuffle=True, seed=args.seed)
        loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                            pin_memory=True, drop_last=True)
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                inp, tgt = x, y
                if len(buffer) > 0:
                    bx, by = buffer.sample(args.replay_batch_size)
                    inp, tgt = torch.cat([x, bx]), torch.cat([y, by])
                logits = model(inp) + seen_mask
                loss = F.cross_entropy(logits, tgt)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                buffer.update(x, y)
                if step % 20 == 0:
                    wandb.log({"train/loss": loss.item(), "train/task": t, "buffer/size": len(buffer)}, step=step)
                step += 1

        acc[t, :t + 1] = eval_tasks(net, test_set, test_targets, tasks[:t + 1], rank, world, device)
        avg = acc[t, :t + 1].mean()
        wandb.log({"eval/avg_acc": avg, **{f"eval/acc_task{j}": acc[t, j] for j in range(t + 1)}}, step=step)
        if rank == 0:
            print(f"task {t:2d}: avg acc {avg:.2f}  " + " ".join(f"{a:.0f}" for a in acc[t, :t + 1]), flush=True)
            os.makedirs(args.save_dir, exist_ok=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "task": t, "acc": acc},
                       os.path.join(args.save_dir, "er_latest.pt"))

    forgetting = np.mean([acc[:-1, j].max() - acc[-1, j] for j in range(args.n_tasks - 1)])
    wandb.log({"final/avg_acc": acc[-1].mean(), "final/forgetting": forgetting})
    if rank == 0:
        np.save(os.path.join(args.save_dir, "acc_matrix.npy"), acc)
    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
