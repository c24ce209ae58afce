"""Domain-incremental DomainNet: clipart -> infograph -> painting -> quickdraw -> real -> sketch.

Experience replay with a per-GPU reservoir buffer that also stores the logits
of the model at insertion time (logit replay, as in DER).

    torchrun --nproc_per_node=8 15_er_domainnet_buffer.py --root /data/domainnet \
        --init /models/resnet50_imagenet.pth
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models, transforms

DOMAINS = ["clipart", "infograph", "painting", "quickdraw", "real", "sketch"]
NUM_CLASSES = 345


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/data/domainnet")
    p.add_argument("--init", default="/models/resnet50_imagenet.pth")
    p.add_argument("--out", default="/data/exp/domainnet_er")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=64, help="per GPU")
    p.add_argument("--replay-batch", type=int, default=32)
    p.add_argument("--buffer", type=int, default=1000, help="slots per GPU")
    p.add_argument("--lr", type=float, default=0.01, help="for a global batch of 256")
    p.add_argument("--alpha", type=float, default=0.3, help="logit replay weight")
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


class DomainNetSplit(Dataset):
    def __init__(self, root, domain, split, tf):
        with open(os.path.join(root, f"{domain}_{split}.txt")) as f:
            rows = [line.split() for line in f if line.strip()]
        self.paths = [os.path.join(root, r[0]) for r in rows]
        self.labels = [int(r[1]) for r in rows]
        self.tf = tf

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        return self.tf(Image.open(self.paths[i]).convert("RGB")), self.labels[i]


class ReplayBuffer:
    """Reservoir buffer holding images, labels and stored logits."""

    def __init__(self, capacity, device="cuda:0"):
        self.capacity = capacity
        self.device = torch.device(device)
        self.n_seen = 0
        self.images = self.labels = self.logits = None

    def __len__(self):
        return min(self.n_seen, self.capacity)

    @torch.no_grad()
    def add(self, images, labels, logits):
        if self.images is None:
            self.images = torch.empty((self.capacity, *images.shape[1:]), device=self.device)
            self.labels = torch.empty(self.capacity, dtype=torch.long, device=self.device)
            self.logits = torch.empty((self.capacity, logits.shape[1]), device=self.device)
        for i in range(images.size(0)):
            slot = self.n_seen if self.n_seen < self.capacity else np.random.randint(0, self.n_seen + 1)
            if slot < self.capacity:
                self.images[slot] = images[i]
                self.labels[slot] = labels[i]
                self.logits[slot] = logits[i]
            self.n_seen += 1

    def sample(self, n):
        idx = torch.randint(0, len(self), (min(n, len(self)),), device=self.device)
        return self.images[idx], self.labels[idx], self.logits[idx]


@torch.no_grad()
def evaluate_domain(net, root, domain, tf, device, rank, world, workers):
    ds = DomainNetSplit(root, domain, "test", tf)
    idx = list(range(rank, len(ds), world))
    loader = DataLoader(torch.utils.data.Subset(ds, idx), batch_size=256, num_workers=workers, pin_memory=True)
    net.eval()
    stat = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        stat[0] += (net(x).argmax(1) == y).sum()
        stat[1] += y.numel()
    dist.all_reduce(stat)
    net.train()
    return (stat[0] / stat[1]).item() * 100


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    np.random.seed(rank)
    torch.manual_seed(rank)

    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([transforms.RandomResizedCrop(224, scale=(0.5, 1.0)),
                                   transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm])
    test_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), norm])

    net = models.resnet50()
    net.load_state_dict(torch.load(args.init, map_location="cpu"))
    net.fc = nn.Linear(2048, NUM_CLASSES)
    net = net.to(device)
    model = DDP(net, device_ids=[local_rank])
    buffer = ReplayBuffer(args.buffer)
    lr = args.lr * args.batch_size * world / 256
    acc = np.zeros((len(DOMAINS), len(DOMAINS)))

    for t, domain in enumerate(DOMAINS):
        train_ds = DomainNetSplit(args.root, domain, "train", train_tf)
        sampler = DistributedSampler(train_ds, shuffle=True)
        loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                            pin_memory=True, drop_last=True, persistent_workers=True)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs * len(loader))

        for ep in range(args.epochs):
            sampler.set_epoch(ep)
            tic = time.time()
            for i, (x, y) in enumerate(loader):
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                n = x.size(0)
                if len(buffer) > 0:
                    bx, by, bz = buffer.sample(args.replay_batch)
                    out = model(torch.cat([x, bx]))
                    loss = F.cross_entropy(out[:n], y) + F.cross_entropy(out[n:], by) \
                        + args.alpha * F.mse_loss(out[n:], bz)
                else:
                    out = model(x)
                    loss = F.cross_entropy(out, y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
                buffer.add(x, y, out[:n].detach())
                if rank == 0 and i % 100 == 0:
                    print(f"[{domain}] ep {ep} it {i}/{len(loader)} loss {loss.item():.3f} "
                          f"lr {sched.get_last_lr()[0]:.5f}", flush=True)
            if rank == 0:
                print(f"[{domain}] epoch {ep} done in {time.time() - tic:.0f}s", flush=True)

        for j in range(t + 1):
            acc[t, j] = evaluate_domain(net, args.root, DOMAINS[j], test_tf, device, rank, world, args.workers)
        if rank == 0:
            print(f"after {domain}: " + " ".join(f"{DOMAINS[j]}={acc[t, j]:.1f}" for j in range(t + 1))
                  + f"  avg={acc[t, :t + 1].mean():.2f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": net.state_dict(), "acc": acc, "domain": t}, os.path.join(args.out, "last.pth"))
        dist.barrier()

    if rank == 0:
        np.savetxt(os.path.join(args.out, "acc_matrix.txt"), acc, fmt="%.2f")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
