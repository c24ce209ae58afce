"""Calibration via focal loss (Mukhoti et al., NeurIPS 2020) + post-hoc temperature scaling.

Trains ResNet-50 on CIFAR-100 with sample-dependent focal loss (FLSD-53:
gamma = 5 if p_y < 0.2 else 3), keeps the checkpoint with the best
validation NLL, then fits a temperature on the validation split and reports
test ECE / AdaECE / NLL before and after scaling.

    torchrun --nproc_per_node=4 20_focal_loss_calibration.py --loss flsd53 --epochs 350
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import transforms as T


def args_():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/cifar100")
    p.add_argument("--out", default="runs/focal_c100")
    p.add_argument("--loss", default="flsd53", choices=["ce", "focal3", "flsd53"])
    p.add_argument("--epochs", type=int, default=350)
    p.add_argument("--batch-size", type=int, default=32, help="per GPU")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--val-size", type=int, default=5000)
    p.add_argument("--resume", action="store_true")
    return p.parse_args()


def resnet50_cifar(num_classes=100):
    m = torchvision.models.resnet50(num_classes=num_classes)
    m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    return m


def focal_loss(logits, y, kind):
    logp = F.log_softmax(logits, -1).gather(1, y[:, None]).squeeze(1)
    if kind == "ce":
        return -logp.mean()
    p = logp.exp()
    if kind == "focal3":
        gamma = torch.full_like(p, 3.0)
    else:
        gamma = torch.where(p < 0.2, torch.full_like(p, 5.0), torch.full_like(p, 3.0))
    return (-(1 - p) ** gamma.detach() * logp).mean()


def ece_metrics(probs, y, n_bins=15):
    conf, pred = probs.max(1)
    hit = pred.eq(y).float()
    b = (conf * n_bins).long().clamp(max=n_bins - 1)
    ece = torch.zeros(n_bins, device=probs.device).index_add_(0, b, conf - hit).abs().sum() / len(y)
    # adaptive: equal-mass bins
    order = conf.argsort()
    ada = sum((conf[c].sum() - hit[c].sum()).abs() for c in order.chunk(n_bins)) / len(y)
    return ece.item(), float(ada)


@torch.no_grad()
def logits_of(model, loader, device):
    model.eval()
    zs, ys = [], []
    for x, y in loader:
        zs.append(model(x.to(device, non_blocking=True)).float())
        ys.append(y.to(device))
    return torch.cat(zs), torch.cat(ys)


@torch.no_grad()
def val_nll(model, loader, device):
    z, y = logits_of(model, loader, device)
    s = torch.stack([F.cross_entropy(z, y, reduction="sum"), z.argmax(1).eq(y).sum().float(),
                     torch.tensor(float(y.numel()), device=device)])
    dist.all_reduce(s)
    return (s[0] / s[2]).item(), (s[1] / s[2]).item()


def fit_temperature(z, y):
    t = nn.Parameter(torch.ones(1, device=z.device) * 1.5)
    opt = torch.optim.LBFGS([t], lr=0.01, max_iter=500)

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(z / t, y)
        loss.backward()
        return loss

    opt.step(closure)
    return t.item()


def main():
    args = args_()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    norm = T.Normalize((0.507, 0.487, 0.441), (0.267, 0.256, 0.276))
    aug = T.Compose([T.RandomCrop(32, 4), T.RandomHorizontalFlip(), T.ToTensor(), norm])
    plain = T.Compose([T.ToTensor(), norm])
    perm = torch.randperm(50000, generator=torch.Generator().manual_seed(1)).tolist()
    train_set = Subset(torchvision.datasets.CIFAR100(args.data, True, aug), perm[args.val_size:])
    val_set = Subset(torchvision.datasets.CIFAR100(args.data, True, plain), perm[:args.val_size])
    test_set = torchvision.datasets.CIFAR100(args.data, False, plain)

    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    val_shard = DataLoader(Subset(val_set, range(rank, len(val_set), world)), 500, num_workers=4)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(resnet50_cifar()).to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = args.lr * world * args.batch_size / 128
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    # Mukhoti et al.: 0.1 for 150 epochs, 0.01 for 100, 0.001 for the rest
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[150, 250], gamma=0.1)
    ckpt_last = os.path.join(args.out, "last.pt")
    ckpt_best = os.path.join(args.out, "best_nll.pt")

    start, best = 0, float("inf")
    if args.resume and os.path.exists(ckpt_last):
        ck = torch.load(ckpt_last, map_location=device)
        model.load_state_dict(ck["state_dict"])
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        start, best = ck["epoch"] + 1, ck["best_nll"]
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = focal_loss(model(x), y, args.loss)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        sched.step()

        nll, acc = val_nll(model, val_shard, device)
        if rank == 0:
            print(f"epoch {epoch} val nll {nll:.4f} acc {acc:.4f} ({time.time() - t0:.0f}s)", flush=True)
            state = {"state_dict": model.state_dict(), "optimizer": opt.state_dict(),
                     "scheduler": sched.state_dict(), "epoch": epoch, "best_nll": min(best, nll)}
            torch.save(state, ckpt_last)
            if nll < best:
                torch.save(state, ckpt_best)
        best = min(best, nll)
        dist.barrier()

    # ---------------- post-hoc temperature scaling on the best-NLL checkpoint (rank 0)
    if rank == 0:
        net = resnet50_cifar().to(device)
        net.load_state_dict(torch.load(ckpt_best, map_location=device)["state_dict"])
        mk = lambda ds: DataLoader(ds, 500, num_workers=4)
        zv, yv = logits_of(net, mk(val_set), device)
        zt, yt = logits_of(net, mk(test_set), device)
        T_opt = fit_temperature(zv, yv)
        res = {"loss": args.loss, "temperature": T_opt}
        for tag, t in (("pre", 1.0), ("post", T_opt)):
            p = F.softmax(zt / t, -1)
            e, ae = ece_metrics(p, yt)
            res[tag] = {"acc": p.argmax(1).eq(yt).float().mean().item(),
                        "nll": F.cross_entropy(zt / t, yt).item(), "ece": e, "adaece": ae}
        print(json.dumps(res, indent=2))
        with open(os.path.join(args.out, "calibration.json"), "w") as f:
            json.dump(res, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
