"""Face analysis with GradNorm task balancing (Chen et al., 2018).

Three datasets, one shared ResNet trunk:
    attrs     CelebA, 40 binary attributes        (162k train)
    landmarks 300W-LP, 68 points                  (61k train)
    age       UTKFace, age regression             (19k train)
Every step takes one batch of each dataset and runs them through the trunk in a
single forward. GradNorm balances the three losses on the last shared layer.

    torchrun --nproc_per_node=4 11_gradnorm_face_tasks.py --root /data/faces --alpha 1.5
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

from facedata import AgeDataset, CelebAAttrs, LandmarkDataset  # project-local loaders

TASKS = ("attrs", "landmarks", "age")


class FaceMTL(nn.Module):
    def __init__(self):
        super().__init__()
        r = torchvision.models.resnet34(weights="IMAGENET1K_V1")
        self.trunk = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool, r.layer1, r.layer2, r.layer3, r.layer4,
                                   nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.shared_fc = nn.Linear(512, 512)  # last shared layer, GradNorm measures gradients here
        self.heads = nn.ModuleDict({"attrs": nn.Linear(512, 40), "landmarks": nn.Linear(512, 136),
                                    "age": nn.Linear(512, 1)})

    def forward(self, images, sizes):
        z = F.relu(self.shared_fc(self.trunk(images)))
        out, i = {}, 0
        for t, n in zip(TASKS, sizes):
            out[t] = self.heads[t](z[i:i + n])
            i += n
        return out


def compute_losses(out, targets):
    return torch.stack([
        F.binary_cross_entropy_with_logits(out["attrs"], targets["attrs"]),
        F.smooth_l1_loss(out["landmarks"], targets["landmarks"], beta=0.02),
        F.l1_loss(out["age"].squeeze(1), targets["age"]) / 10.0,
    ])


class GradNorm:
    """Keeps the task weights as a plain tensor, updated by hand, identical on all ranks."""

    def __init__(self, n, alpha, lr, device):
        self.w = torch.ones(n, device=device)
        self.alpha, self.lr = alpha, lr
        self.L0 = None

    def step(self, losses, shared_weight, world):
        # per-task gradient of the (unweighted) loss w.r.t. the shared layer, averaged over ranks
        grads = torch.stack([
            torch.autograd.grad(l, shared_weight, retain_graph=True)[0].flatten() for l in losses
        ])
        dist.all_reduce(grads)
        grads /= world
        g = grads.norm(dim=1)  # ||grad L_i||, so G_i = w_i * g_i

        mean_losses = losses.detach().clone()
        dist.all_reduce(mean_losses)
        mean_losses /= world
        if self.L0 is None:
            self.L0 = mean_losses.clone()
        ratio = mean_losses / self.L0
        r = ratio / ratio.mean()

        G = self.w * g
        target = (G.mean() * r ** self.alpha).detach()
        # d/dw_i sum_j |w_j g_j - target_j| = sign(w_i g_i - target_i) * g_i
        self.w -= self.lr * torch.sign(G - target) * g
        self.w.clamp_(min=1e-3)
        self.w *= len(self.w) / self.w.sum()
        return G


def stream(loader, sampler):
    ep = 0
    while True:
        sampler.set_epoch(ep)
        yield from loader
        ep += 1


@torch.no_grad()
def evaluate(net, val_sets, device, rank, world):
    net.eval()
    sums = torch.zeros(6, dtype=torch.float64, device=device)  # attr ok, attr n, nme sum, lm n, age abs, age n
    for k, t in enumerate(TASKS):
        part = Subset(val_sets[t], range(rank, len(val_sets[t]), world))
        for x, y in DataLoader(part, batch_size=256, num_workers=4):
            x, y = x.to(device), y.to(device)
            sizes = [x.size(0) if j == k else 0 for j in range(len(TASKS))]
            o = net(x, sizes)[t]
            if t == "attrs":
                sums[0] += ((o > 0).float() == y).sum()
                sums[1] += y.numel()
            elif t == "landmarks":
                p, q = o.view(-1, 68, 2), y.view(-1, 68, 2)
                iod = (q[:, 36] - q[:, 45]).norm(dim=1)  # outer eye corners
                sums[2] += ((p - q).norm(dim=2).mean(1) / iod).sum()
                sums[3] += x.size(0)
            else:
                sums[4] += (o.squeeze(1) - y).abs().sum()
                sums[5] += x.size(0)
    dist.all_reduce(sums)
    net.train()
    return {"attr_acc": (sums[0] / sums[1]).item(), "nme": (sums[2] / sums[3]).item(),
            "age_mae": (sums[4] / sums[5]).item()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", default="runs/gradnorm_face")
    ap.add_argument("--alpha", type=float, default=1.5)
    ap.add_argument("--w_lr", type=float, default=0.025)
    ap.add_argument("--bs", type=int, nargs=3, default=[64, 32, 32])
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--steps", type=int, default=50000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_sets = {"attrs": CelebAAttrs(args.root, "train"), "landmarks": LandmarkDataset(args.root, "train"),
                  "age": AgeDataset(args.root, "train")}
    val_sets = {"attrs": CelebAAttrs(args.root, "val"), "landmarks": LandmarkDataset(args.root, "val"),
                "age": AgeDataset(args.root, "val")}
    streams = {}
    for t, bs in zip(TASKS, args.bs):
        s = DistributedSampler(train_sets[t], shuffle=True)
        dl = DataLoader(train_sets[t], batch_size=bs, sampler=s, num_workers=4, pin_memory=True, drop_last=True)
        streams[t] = stream(dl, s)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(FaceMTL()).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    gradnorm = GradNorm(len(TASKS), args.alpha, args.w_lr, device)
    shared_w = model.module.shared_fc.weight

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    for step in range(args.steps):
        batches = {t: next(streams[t]) for t in TASKS}
        images = torch.cat([batches[t][0] for t in TASKS]).to(device, non_blocking=True)
        targets = {t: batches[t][1].to(device, non_blocking=True) for t in TASKS}
        out = model(images, [batches[t][0].size(0) for t in TASKS])
        losses = compute_losses(out, targets)

        G = gradnorm.step(losses, shared_w, world)
        total = (gradnorm.w * losses).sum()
        opt.zero_grad(set_to_none=True)
        total.backward()
        opt.step()
        sched.step()

        if rank == 0 and step % 100 == 0:
            print(f"step {step} losses {losses.detach().cpu().numpy().round(4)} "
                  f"w {gradnorm.w.cpu().numpy().round(3)} G {G.cpu().numpy().round(4)} "
                  f"({time.time() - t0:.0f}s)", flush=True)
        if (step + 1) % 5000 == 0:
            metrics = evaluate(model.module, val_sets, device, rank, world)
            if rank == 0:
                print(f"eval {step + 1}: {metrics}", flush=True)
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                            "task_weights": gradnorm.w.cpu(), "L0": gradnorm.L0.cpu(), "step": step + 1},
                           os.path.join(args.out, f"step{step + 1}.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
