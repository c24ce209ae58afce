"""DER++ (Buzzega et al., 2020) on Seq-CIFAR-10, class-IL, data-parallel over GPUs.

Each rank keeps its own reservoir buffer over the stream it sees (its shard of every task),
so the total memory is --buffer-size spread evenly over ranks.

torchrun --standalone --nproc_per_node=4 02_derpp_seq_cifar10.py --buffer-size 500 --alpha 0.1 --beta 0.5
"""
import argparse
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

N_TASKS, CPT = 5, 2
MEAN = torch.tensor([0.4914, 0.4822, 0.4465]).view(1, 3, 1, 1)
STD = torch.tensor([0.2470, 0.2435, 0.2615]).view(1, 3, 1, 1)


class SeqCIFAR10(Dataset):
    """Returns (augmented, label, non-augmented) like the Mammoth loaders."""

    def __init__(self, base, classes, train):
        self.data = base.data
        targets = np.asarray(base.targets)
        self.idx = np.flatnonzero(np.isin(targets, classes))
        self.targets = targets
        self.train = train
        self.aug = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip()])

    def __len__(self):
        return len(self.idx)

    def __getitem__(self, i):
        j = self.idx[i]
        img = torch.from_numpy(self.data[j]).permute(2, 0, 1).float().div_(255)
        aug = self.aug(img) if self.train else img
        return aug, int(self.targets[j]), img


class Reservoir:
    def __init__(self, size, device):
        self.size, self.device, self.seen = size, device, 0
        self.x = torch.zeros(size, 3, 32, 32, device=device)
        self.y = torch.zeros(size, dtype=torch.long, device=device)
        self.logits = torch.zeros(size, 10, device=device)

    def __len__(self):
        return min(self.seen, self.size)

    def add(self, x, y, logits):
        for i in range(x.size(0)):
            if self.seen < self.size:
                j = self.seen
            else:
                j = random.randint(0, self.seen)
            if j < self.size:
                self.x[j], self.y[j], self.logits[j] = x[i], y[i], logits[i]
            self.seen += 1

    def sample(self, n, transform):
        choice = torch.randperm(len(self), device=self.device)[:n]
        x = torch.stack([transform(img) for img in self.x[choice]])
        return x, self.y[choice], self.logits[choice]


def normalize(x):
    return (x - MEAN.to(x.device)) / STD.to(x.device)


def make_model():
    net = torchvision.models.resnet18(num_classes=10)
    net.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    net.maxpool = nn.Identity()
    return net


@torch.no_grad()
def evaluate(net, test_base, device, n_seen_tasks, rank, world):
    """Task-wise accuracy; every rank scores a strided slice and the counts are summed."""
    net.eval()
    out = []
    for t in range(n_seen_tasks):
        ds = SeqCIFAR10(test_base, list(range(t * CPT, (t + 1) * CPT)), train=False)
        ds.idx = ds.idx[rank::world]
        loader = DataLoader(ds, batch_size=256, num_workers=2)
        stats = torch.zeros(2, device=device)
        for x, y, _ in loader:
            x, y = x.to(device), y.to(device)
            pred = net(normalize(x))[:, : n_seen_tasks * CPT].argmax(1)
            stats[0] += (pred == y).sum()
            stats[1] += y.numel()
        dist.all_reduce(stats)
        out.append((100 * stats[0] / stats[1]).item())
    net.train()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-root", default=os.environ.get("DATA_ROOT", "./data"))
    ap.add_argument("--ckpt-dir", default="./checkpoints/derpp")
    ap.add_argument("--buffer-size", type=int, default=500)
    ap.add_argument("--alpha", type=float, default=0.1)
    ap.add_argument("--beta", type=float, default=0.5)
    ap.add_argument("--lr", type=float, default=0.03)
    ap.add_argument("--n-epochs", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=8, help="per GPU; 4 GPUs x 8 = 32 as in the paper")
    ap.add_argument("--minibatch-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")

    # same init everywhere; buffer sampling differs per rank on purpose
    torch.manual_seed(args.seed)
    random.seed(args.seed + rank)

    if rank == 0:
        torchvision.datasets.CIFAR10(args.data_root, train=True, download=True)
        torchvision.datasets.CIFAR10(args.data_root, train=False, download=True)
        os.makedirs(args.ckpt_dir, exist_ok=True)
    dist.barrier()
    train_base = torchvision.datasets.CIFAR10(args.data_root, train=True)
    test_base = torchvision.datasets.CIFAR10(args.data_root, train=False)

    net = make_model().to(device)
    model = DistributedDataParallel(net, device_ids=[local_rank])
    buffer = Reservoir(args.buffer_size // world, device)
    buf_aug = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip()])
    acc_matrix = np.zeros((N_TASKS, N_TASKS))

    for task in range(N_TASKS):
        ds = SeqCIFAR10(train_base, list(range(task * CPT, (task + 1) * CPT)), train=True)
        sampler = DistributedSampler(ds, shuffle=True, seed=args.seed, drop_last=True)
        loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler,
                            num_workers=4, pin_memory=True, drop_last=True)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr)
        model.train()
        for epoch in range(args.n_epochs):
            sampler.set_epoch(epoch)
            tic = time.time()
            for it, (inputs, labels, not_aug) in enumerate(loader):
                inputs = normalize(inputs.to(device, non_blocking=True))
                labels = labels.to(device, non_blocking=True)
                not_aug = not_aug.to(device, non_blocking=True)

                opt.zero_grad()
                outputs = model(inputs)
                loss = F.cross_entropy(outputs, labels)
                if len(buffer) > 0:
                    buf_x, _, buf_logits = buffer.sample(args.minibatch_size, buf_aug)
                    buf_out = model(normalize(buf_x))
                    loss = loss + args.alpha * F.mse_loss(buf_out, buf_logits)

                    buf_x, buf_y, _ = buffer.sample(args.minibatch_size, buf_aug)
                    buf_out = model(normalize(buf_x))
                    loss = loss + args.beta * F.cross_entropy(buf_out, buf_y)
                loss.backward()
                opt.step()

                buffer.add(not_aug, labels, outputs.detach())
                if rank == 0 and it % 100 == 0:
                    print(f"[task {task} ep {epoch} it {it}] loss {loss.item():.4f}", flush=True)
            if rank == 0:
                print(f"task {task} epoch {epoch} done in {time.time() - tic:.1f}s", flush=True)

        accs = evaluate(net, test_base, device, task + 1, rank, world)
        acc_matrix[task, : task + 1] = accs
        if rank == 0:
            bwt = (np.mean([acc_matrix[task, j] - acc_matrix[j, j] for j in range(task)])
                   if task > 0 else 0.0)
            print(f"== after task {task}: {[f'{a:.2f}' for a in accs]}  "
                  f"mean {np.mean(accs):.2f}  BWT {bwt:.2f}", flush=True)
            torch.save({"task": task, "model": net.state_dict(), "acc": acc_matrix},
                       os.path.join(args.ckpt_dir, f"derpp_task{task}.pt"))
        torch.save({"x": buffer.x, "y": buffer.y, "logits": buffer.logits, "seen": buffer.seen},
                   os.path.join(args.ckpt_dir, f"buffer_task{task}_rank{rank}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
