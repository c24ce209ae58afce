"""FastFlow (2D normalising flow on frozen CNN features) for cast-part X-ray inspection.

Backbone: ResNet18 stages 1-3, frozen and in eval mode (its BatchNorm layers
are never trained). One 2D flow per stage, alternating 3x3 / 1x1 subnets.
Gradient accumulation keeps the reference global batch on fewer GPUs.

    torchrun --nproc_per_node=2 17_fastflow_train.py --data /data/xray_cast --out /shared/xray/fastflow \
        --global-batch 32 --accum 2
"""
import argparse
import math
import os
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from torchvision.models import resnet18, ResNet18_Weights


class XrayFolder(Dataset):
    """<root>/<split>/<good|defect_type>/*.png, 16-bit grayscale."""

    def __init__(self, root, split, size):
        base = os.path.join(root, split)
        self.items = [(os.path.join(base, d, f), int(d != "good"))
                      for d in sorted(os.listdir(base)) for f in sorted(os.listdir(os.path.join(base, d)))
                      if f.endswith(".png")]
        self.size = size
        self.norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        self.flip = split == "train"

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, y = self.items[i]
        arr = np.asarray(Image.open(path), dtype=np.float32)
        arr = (arr - arr.min()) / (arr.max() - arr.min() + 1e-6)
        x = torch.from_numpy(arr)[None].expand(3, -1, -1)
        x = F.interpolate(x[None], size=(self.size, self.size), mode="bilinear", align_corners=False)[0]
        if self.flip and torch.rand(1).item() < 0.5:
            x = x.flip(-1)
        return self.norm(x), y, i


def subnet(cin, cout, k):
    return nn.Sequential(nn.Conv2d(cin, cin, k, padding=k // 2), nn.ReLU(), nn.Conv2d(cin, cout, k, padding=k // 2))


class AffineCoupling(nn.Module):
    def __init__(self, channels, kernel, clamp=2.0):
        super().__init__()
        self.c1 = channels // 2
        self.c2 = channels - self.c1
        self.net = subnet(self.c1, 2 * self.c2, kernel)
        self.clamp = clamp
        self.register_buffer("perm", torch.randperm(channels))

    def forward(self, x):
        x = x[:, self.perm]
        x1, x2 = x[:, :self.c1], x[:, self.c1:]
        s, t = self.net(x1).chunk(2, dim=1)
        s = self.clamp * torch.tanh(s / self.clamp)
        y2 = x2 * torch.exp(s) + t
        return torch.cat([x1, y2], 1), s.flatten(1).sum(1)


class FastFlow(nn.Module):
    def __init__(self, steps=8, size=256):
        super().__init__()
        net = resnet18(weights=ResNet18_Weights.IMAGENET1K_V1)
        self.backbone = nn.ModuleList([nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool, net.layer1),
                                       net.layer2, net.layer3])
        self.backbone.requires_grad_(False)
        chans, scales = [64, 128, 256], [4, 8, 16]
        self.norms = nn.ModuleList([nn.LayerNorm([c, size // s, size // s], elementwise_affine=True)
                                    for c, s in zip(chans, scales)])
        self.flows = nn.ModuleList([nn.ModuleList([AffineCoupling(c, 3 if i % 2 == 0 else 1) for i in range(steps)])
                                    for c in chans])

    def train(self, mode=True):
        super().train(mode)
        self.backbone.eval()
        return self

    def forward(self, x):
        with torch.no_grad():
            feats = []
            for stage in self.backbone:
                x = stage(x)
                feats.append(x)
        zs, log_jacs = [], []
        for f, norm, flow in zip(feats, self.norms, self.flows):
            z, lj = norm(f), 0
            for block in flow:
                z, l = block(z)
                lj = lj + l
            zs.append(z)
            log_jacs.append(lj)
        return zs, log_jacs


def nll_loss(zs, log_jacs):
    loss = 0
    for z, lj in zip(zs, log_jacs):
        loss = loss + torch.mean(0.5 * z.pow(2).flatten(1).sum(1) - lj)
    return loss


@torch.no_grad()
def anomaly_scores(model, x, size):
    zs, _ = model(x)
    amap = 0
    for z in zs:
        prob = torch.exp(-0.5 * z.pow(2).mean(1, keepdim=True))
        amap = amap - F.interpolate(prob, size=(size, size), mode="bilinear", align_corners=False)
    return amap.flatten(1).amax(1)


@torch.no_grad()
def distributed_eval(model, loader, device, n_total, size):
    """Each rank scores its shard; gather (index, score, label) and de-duplicate the sampler padding."""
    model.eval()
    idx, sc, lb = [], [], []
    for x, y, i in loader:
        sc.append(anomaly_scores(model, x.to(device, non_blocking=True), size))
        lb.append(y.to(device))
        idx.append(i.to(device))
    local = torch.stack([torch.cat(idx).double(), torch.cat(sc).double(), torch.cat(lb).double()], 1)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)  # same length on every rank thanks to the sampler padding
    allr = torch.cat(gathered).cpu().numpy()
    _, first = np.unique(allr[:, 0], return_index=True)
    allr = allr[first]
    assert len(allr) == n_total
    return roc_auc_score(allr[:, 2], allr[:, 1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--accum", type=int, default=1, help="gradient accumulation steps")
    ap.add_argument("--lr", type=float, default=1e-3, help="for the global batch")
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    assert args.global_batch % (world * args.accum) == 0
    micro = args.global_batch // (world * args.accum)

    train_ds, test_ds = XrayFolder(args.data, "train", args.size), XrayFolder(args.data, "test", args.size)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True, seed=17)
    test_sampler = DistributedSampler(test_ds, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=micro, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    test_dl = DataLoader(test_ds, batch_size=16, sampler=test_sampler, num_workers=args.workers, pin_memory=True)

    torch.manual_seed(17)  # same coupling permutations everywhere (DDP broadcasts them anyway)
    model = DDP(FastFlow(size=args.size).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=1e-5)
    updates_per_epoch = len(train_dl) // args.accum
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda u: 0.5 * (1 + math.cos(math.pi * u / max(1, args.epochs * updates_per_epoch))))

    ckpt_path = os.path.join(args.out, "fastflow_last.pt")
    start_epoch, best = 0, 0.0
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    if args.resume and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location={"cuda:0": f"cuda:{local_rank}"})
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        running = torch.zeros(2, device=device)
        opt.zero_grad(set_to_none=True)
        for it, (x, _, _) in enumerate(train_dl):
            last_micro = (it + 1) % args.accum == 0
            # only all-reduce gradients on the last micro-batch of each accumulation window
            with model.no_sync() if not last_micro else nullcontext():
                zs, ljs = model(x.to(device, non_blocking=True))
                loss = nll_loss(zs, ljs) / args.accum
                loss.backward()
            if last_micro:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
            running += torch.stack([loss.detach() * args.accum, torch.ones((), device=device)])
        opt.zero_grad(set_to_none=True)  # drop a trailing partial window
        dist.all_reduce(running)

        auroc = distributed_eval(model.module, test_dl, device, len(test_ds), args.size)
        if rank == 0:
            print(f"epoch {epoch:3d} nll {(running[0] / running[1]).item():.1f} AUROC {auroc:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            best = max(best, auroc)
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                     "epoch": epoch, "best": best}
            torch.save(state, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
            if auroc >= best:
                torch.save(state, os.path.join(args.out, "fastflow_best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
