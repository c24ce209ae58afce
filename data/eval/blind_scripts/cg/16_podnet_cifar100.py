"""PODNet-style training (POD-spatial + POD-flat distillation, cosine classifier) on
class-incremental CIFAR-100, B50 with 10 steps of 5 classes, ResNet-32.

Each step's model is stored in --ckpt-dir and reloaded as the teacher of the next step.

    torchrun --nproc_per_node=2 16_podnet_cifar100.py --ckpt-dir /checkpoints/podnet_b50_s10
"""
import argparse
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


class Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet32(nn.Module):
    def __init__(self, n=5):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        cfg, cin, stages = [(16, 1), (32, 2), (64, 2)], 16, []
        for cout, s in cfg:
            stages.append(nn.Sequential(*[Block(cin if i == 0 else cout, cout, s if i == 0 else 1)
                                          for i in range(n)]))
            cin = cout
        self.stages = nn.ModuleList(stages)
        self.out_dim = 64

    def forward(self, x):
        maps = []
        x = self.stem(x)
        for st in self.stages:
            x = st(x)
            maps.append(x)
        return maps, F.adaptive_avg_pool2d(x, 1).flatten(1)


class CosineHead(nn.Module):
    def __init__(self, dim, n_classes, proxies=10):
        super().__init__()
        self.proxies = proxies
        self.weight = nn.Parameter(torch.randn(n_classes * proxies, dim) * 0.01)
        self.scale = nn.Parameter(torch.tensor(1.0))

    def forward(self, f):
        sim = F.linear(F.normalize(f, dim=1), F.normalize(self.weight, dim=1))
        sim = sim.view(f.size(0), -1, self.proxies)
        att = F.softmax(sim, dim=-1)
        return self.scale * (att * sim).sum(-1)


class PodNet(nn.Module):
    def __init__(self, n_classes):
        super().__init__()
        self.backbone = ResNet32()
        self.head = CosineHead(self.backbone.out_dim, n_classes)

    def grow(self, n_new):
        old = self.head
        head = CosineHead(self.backbone.out_dim, old.weight.size(0) // old.proxies + n_new).to(old.weight.device)
        with torch.no_grad():
            head.weight[: old.weight.size(0)] = old.weight
            head.scale.copy_(old.scale)
        self.head = head

    def forward(self, x):
        maps, f = self.backbone(x)
        return self.head(f), f, maps


def pod_spatial(new_maps, old_maps):
    loss = 0.0
    for a, b in zip(new_maps, old_maps):
        a, b = a.pow(2), b.pow(2)
        a = torch.cat([a.sum(2).flatten(1), a.sum(3).flatten(1)], 1)
        b = torch.cat([b.sum(2).flatten(1), b.sum(3).flatten(1)], 1)
        loss = loss + (F.normalize(a, dim=1) - F.normalize(b, dim=1)).norm(dim=1).mean()
    return loss / len(new_maps)


def nca_loss(logits, y, margin=0.6, scale=1.0):
    logits = logits.clone()
    logits[torch.arange(len(y)), y] -= margin
    return F.cross_entropy(scale * logits, y)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/cifar100")
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--base", type=int, default=50)
    p.add_argument("--inc", type=int, default=5)
    p.add_argument("--epochs", type=int, default=160)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--mem-per-class", type=int, default=20)
    p.add_argument("--lambda-spatial", type=float, default=3.0)
    p.add_argument("--lambda-flat", type=float, default=1.0)
    args = p.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1993)

    order = np.random.RandomState(1993).permutation(100)
    lab = np.argsort(order)
    norm = transforms.Normalize((0.5071, 0.4866, 0.4409), (0.2673, 0.2564, 0.2762))
    if rank == 0:
        datasets.CIFAR100(args.data, True, download=True)
        datasets.CIFAR100(args.data, False, download=True)
        os.makedirs(args.ckpt_dir, exist_ok=True)
    dist.barrier()
    train = datasets.CIFAR100(args.data, True, transforms.Compose([
        transforms.RandomCrop(32, 4), transforms.RandomHorizontalFlip(),
        transforms.ColorJitter(brightness=63 / 255), transforms.ToTensor(), norm]),
        target_transform=lambda y: int(lab[y]))
    test = datasets.CIFAR100(args.data, False, transforms.Compose([transforms.ToTensor(), norm]),
                             target_transform=lambda y: int(lab[y]))
    ytr, yte = lab[np.array(train.targets)], lab[np.array(test.targets)]
    bounds = [0] + list(range(args.base, 101, args.inc))

    net = PodNet(args.base).to(device)
    memory = {}
    mem_rng = np.random.RandomState(0)
    accs = []

    for s in range(len(bounds) - 1):
        lo, hi = bounds[s], bounds[s + 1]
        teacher = None
        if s > 0:
            net.grow(hi - lo)
            teacher = PodNet(lo).to(device)
            state = torch.load(os.path.join(args.ckpt_dir, f"step{s - 1}.pt"), map_location=device)
            teacher.load_state_dict(state["model"])
            teacher.eval().requires_grad_(False)
        model = DDP(net, device_ids=[local_rank])

        idx = np.flatnonzero((ytr >= lo) & (ytr < hi)).tolist() + [i for c in memory for i in memory[c]]
        ds = Subset(train, idx)
        sampler = DistributedSampler(ds, shuffle=True, seed=s)
        loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                            pin_memory=True, drop_last=True)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr if s == 0 else args.lr / 2,
                              momentum=0.9, weight_decay=5e-4)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs)
        factor = math.sqrt(hi / (hi - lo))

        for ep in range(args.epochs):
            model.train()
            sampler.set_epoch(ep)
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                logits, feat, maps = model(x)
                loss = nca_loss(logits, y)
                if teacher is not None:
                    with torch.no_grad():
                        _, t_feat, t_maps = teacher(x)
                    loss = loss + args.lambda_spatial * factor * pod_spatial(maps, t_maps)
                    loss = loss + args.lambda_flat * factor * (
                        F.normalize(feat, dim=1) - F.normalize(t_feat, dim=1)).norm(dim=1).mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            sched.step()
            if rank == 0 and ep % 20 == 0:
                print(f"step {s} ep {ep} loss {loss.item():.4f}", flush=True)

        for c in range(lo, hi):
            memory[c] = mem_rng.choice(np.flatnonzero(ytr == c), args.mem_per_class, replace=False).tolist()

        # evaluation on all classes seen so far, split across ranks
        net.eval()
        te = np.flatnonzero(yte < hi)[rank::world]
        c = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in DataLoader(Subset(test, te), batch_size=200, num_workers=2):
                x, y = x.to(device), y.to(device)
                c[0] += (net(x)[0].argmax(1) == y).sum()
                c[1] += len(y)
        dist.all_reduce(c)
        accs.append((100 * c[0] / c[1]).item())
        if rank == 0:
            print(f"== step {s}: {hi} classes, acc {accs[-1]:.2f}, avg inc {np.mean(accs):.2f}", flush=True)
            torch.save({"model": model.state_dict(), "step": s, "memory": memory, "accs": accs},
                       os.path.join(args.ckpt_dir, f"step{s}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
