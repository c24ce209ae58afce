"""Hardware-aware DNAS (FBNet-style) on an ImageNet-100 proxy, latency lookup table
measured on the target phone.  Loss = CE * alpha * log(LAT)^beta.

    torchrun --standalone --nproc_per_node=8 19_fbnet_latency_search.py \
        --data /datasets/imagenet100 --lut luts/pixel7_fbnet_space.json
"""
import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

DEVICE = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")

# (kernel, expansion, groups) of each candidate block; "skip" last
CANDIDATES = [(3, 1, 1), (3, 1, 2), (3, 3, 1), (3, 6, 1), (5, 1, 1), (5, 1, 2), (5, 3, 1), (5, 6, 1), "skip"]
# (out_channels, num_layers, stride)
LAYOUT = [(24, 4, 2), (32, 4, 2), (64, 4, 2), (112, 4, 1), (184, 4, 2), (352, 1, 1)]


class IRBlock(nn.Module):
    def __init__(self, cin, cout, stride, k, e, g):
        super().__init__()
        mid = cin * e
        self.res = stride == 1 and cin == cout
        self.body = nn.Sequential(
            nn.Conv2d(cin, mid, 1, groups=g, bias=False), nn.BatchNorm2d(mid), nn.ReLU(inplace=True),
            nn.Conv2d(mid, mid, k, stride, k // 2, groups=mid, bias=False), nn.BatchNorm2d(mid), nn.ReLU(inplace=True),
            nn.Conv2d(mid, cout, 1, groups=g, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = self.body(x)
        return x + y if self.res else y


class MixedLayer(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        ops = []
        for c in CANDIDATES:
            if c == "skip":
                ops.append(nn.Identity() if (stride == 1 and cin == cout) else
                           nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)))
            else:
                k, e, g = c
                g = g if cin % g == 0 and cout % g == 0 else 1
                ops.append(IRBlock(cin, cout, stride, k, e, g))
        self.ops = nn.ModuleList(ops)

    def forward(self, x, w):
        return sum(wi * op(x) for wi, op in zip(w, self.ops))


class FBNetSupernet(nn.Module):
    def __init__(self, num_classes=100):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True))
        layers, cin = [], 16
        for cout, n, s in LAYOUT:
            for i in range(n):
                layers.append(MixedLayer(cin, cout, s if i == 0 else 1))
                cin = cout
        self.layers = nn.ModuleList(layers)
        self.head = nn.Sequential(nn.Conv2d(cin, 1504, 1, bias=False), nn.BatchNorm2d(1504), nn.ReLU(inplace=True))
        self.fc = nn.Linear(1504, num_classes)
        self.theta = nn.Parameter(torch.zeros(len(layers), len(CANDIDATES)))

    def forward(self, x, temperature):
        weights = F.gumbel_softmax(self.theta, tau=temperature, dim=-1)
        x = self.stem(x)
        for layer, w in zip(self.layers, weights):
            x = layer(x, w)
        logits = self.fc(F.adaptive_avg_pool2d(self.head(x), 1).flatten(1))
        return logits, weights


class LatencyLoss(nn.Module):
    def __init__(self, lut, alpha=0.2, beta=0.6):
        super().__init__()
        # lut[layer][candidate] in milliseconds
        self.lut = torch.tensor(lut, dtype=torch.float32, device=DEVICE)
        self.alpha, self.beta = alpha, beta

    def forward(self, logits, targets, weights):
        ce = F.cross_entropy(logits, targets)
        lat = (weights * self.lut).sum()
        return ce * self.alpha * torch.log(lat) ** self.beta, ce.detach(), lat.detach()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--lut", required=True)
    ap.add_argument("--out", default="output/fbnet_search")
    ap.add_argument("--epochs", type=int, default=90)
    ap.add_argument("--warmup-epochs", type=int, default=10, help="weights only")
    ap.add_argument("--bs", type=int, default=96, help="per GPU")
    ap.add_argument("--w-lr", type=float, default=0.1)
    ap.add_argument("--theta-lr", type=float, default=0.01)
    ap.add_argument("--t0", type=float, default=5.0)
    ap.add_argument("--t-decay", type=float, default=0.956)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    with open(args.lut) as f:
        lut = json.load(f)["latency_ms"]
    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    full = datasets.ImageFolder(os.path.join(args.data, "train"), transforms.Compose([
        transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm]))
    # FBNet: 80% of the training images train the weights, 20% train theta
    perm = torch.randperm(len(full), generator=torch.Generator().manual_seed(42)).tolist()
    cut = int(0.8 * len(full))
    w_set, t_set = Subset(full, perm[:cut]), Subset(full, perm[cut:])
    w_sampler, t_sampler = DistributedSampler(w_set, drop_last=True), DistributedSampler(t_set, drop_last=True)
    w_loader = DataLoader(w_set, args.bs, sampler=w_sampler, num_workers=10, pin_memory=True, drop_last=True)
    t_loader = DataLoader(t_set, args.bs, sampler=t_sampler, num_workers=10, pin_memory=True, drop_last=True)

    net = FBNetSupernet().to(device)
    model = DDP(net, device_ids=[local_rank])
    w_params = [p for n, p in net.named_parameters() if n != "theta"]
    w_opt = torch.optim.SGD(w_params, lr=args.w_lr * args.bs * world / 256, momentum=0.9, weight_decay=1e-4)
    t_opt = torch.optim.Adam([net.theta], lr=args.theta_lr, weight_decay=5e-4)
    w_sched = torch.optim.lr_scheduler.CosineAnnealingLR(w_opt, args.epochs)
    criterion = LatencyLoss(lut)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    temperature = args.t0
    for epoch in range(args.epochs):
        w_sampler.set_epoch(epoch)
        t_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for x, y in w_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits, weights = model(x, temperature)
            loss, ce, lat = criterion(logits, y, weights)
            w_opt.zero_grad(set_to_none=True)
            loss.backward()
            w_opt.step()
        w_sched.step()

        stats = torch.zeros(3, device=device)
        if epoch >= args.warmup_epochs:
            for x, y in t_loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                logits, weights = model(x, temperature)
                loss, ce, lat = criterion(logits, y, weights)
                t_opt.zero_grad(set_to_none=True)
                loss.backward()
                t_opt.step()
                stats += torch.stack([ce, lat, torch.ones((), device=device)])
            temperature *= args.t_decay
        dist.all_reduce(stats)

        if rank == 0:
            arch = net.theta.argmax(-1).tolist()
            exp_lat = sum(lut[i][a] for i, a in enumerate(arch))
            n = max(stats[2].item(), 1.0)
            print(f"epoch {epoch} T={temperature:.3f} theta-ce {stats[0].item() / n:.3f} "
                  f"E[lat] {stats[1].item() / n:.2f}ms argmax-lat {exp_lat:.2f}ms ({time.time() - tic:.0f}s)", flush=True)
            torch.save({"epoch": epoch, "model": net.state_dict(), "arch": arch,
                        "candidates": [str(c) for c in CANDIDATES], "temperature": temperature},
                       os.path.join(args.out, "search_state.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
