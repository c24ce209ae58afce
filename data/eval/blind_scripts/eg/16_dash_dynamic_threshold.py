"""Dash (Xu et al., ICML 2021): SSL with dynamic thresholding on the unlabelled loss.

An unlabelled example is used at step t only if its pseudo-label loss is below
rho_t = C * gamma^-(t-1) * rho_hat, where rho_hat is the average supervised loss
measured after a short supervised warm-up.

    torchrun --nproc_per_node=4 16_dash_dynamic_threshold.py --dataset cifar100 --n-labels 2500
"""
import argparse
import math
import os
import time
from copy import deepcopy

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

from ssl_data import build_datasets
from ssl_models import create_wrn


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", default="cifar100")
    ap.add_argument("--root", default="./data")
    ap.add_argument("--save", default="./ckpt/dash")
    ap.add_argument("--n-labels", type=int, default=2500)
    ap.add_argument("--bs", type=int, default=16, help="labelled batch per GPU")
    ap.add_argument("--uratio", type=int, default=7)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--lr", type=float, default=0.03)
    ap.add_argument("--wd", type=float, default=1e-3)
    ap.add_argument("--warmup-iters", type=int, default=5000, help="supervised warm-up to estimate rho_hat")
    ap.add_argument("--C", type=float, default=1.0001)
    ap.add_argument("--gamma", type=float, default=1.27)
    ap.add_argument("--rho-min", type=float, default=0.05)
    ap.add_argument("--dash-interval", type=int, default=9 * 1024, help="iterations between threshold updates")
    ap.add_argument("--T", type=float, default=0.5)
    ap.add_argument("--ema", type=float, default=0.999)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=4)
    return ap.parse_args()


def endless(loader):
    while True:
        for batch in loader:
            yield batch


class EMA:
    def __init__(self, model, decay):
        self.model = deepcopy(model).eval()
        self.decay = decay

    @torch.no_grad()
    def update(self, model):
        for e, m in zip(self.model.state_dict().values(), model.state_dict().values()):
            if e.dtype.is_floating_point:
                e.mul_(self.decay).add_(m, alpha=1 - self.decay)
            else:
                e.copy_(m)


@torch.no_grad()
def mean_over_ranks(value, device):
    t = torch.tensor([value], device=device, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).item()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct = torch.zeros(1, device=device)
    count = torch.zeros(1, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        correct += (model(x).argmax(1) == y).sum()
        count += y.numel()
    dist.all_reduce(correct)
    dist.all_reduce(count)
    return (correct / count * 100).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)

    if rank == 0:
        build_datasets(args.dataset, args.root, args.n_labels, seed=args.seed, download=True)
    dist.barrier()
    lb_set, ulb_set, test_set, num_classes = build_datasets(args.dataset, args.root, args.n_labels, seed=args.seed)

    lb_sampler = DistributedSampler(lb_set, shuffle=True, drop_last=True)
    ulb_sampler = DistributedSampler(ulb_set, shuffle=True, drop_last=True)
    lb_loader = DataLoader(lb_set, args.bs, sampler=lb_sampler, num_workers=args.workers,
                           pin_memory=True, drop_last=True)
    ulb_loader = DataLoader(ulb_set, args.bs * args.uratio, sampler=ulb_sampler, num_workers=args.workers,
                            pin_memory=True, drop_last=True)
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world)), 500, num_workers=args.workers)

    model = create_wrn(depth=28, widen=8 if num_classes == 100 else 2, num_classes=num_classes).to(device)
    ema = EMA(model, args.ema)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True,
                                weight_decay=args.wd)
    steps_per_epoch = len(ulb_loader)
    total = args.epochs * steps_per_epoch
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: math.cos(7 * math.pi * s / (16 * total)))

    lb_stream = endless(lb_loader)

    # ---- supervised warm-up, then rho_hat = average supervised loss over all ranks
    model.train()
    warm_loss = 0.0
    for i in range(args.warmup_iters):
        x, y = next(lb_stream)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if i >= args.warmup_iters - 100:
            warm_loss += loss.item() / 100
    rho_hat = mean_over_ranks(warm_loss, device)
    rho, dash_step = args.C * rho_hat, 1
    if rank == 0:
        print(f"warm-up done: rho_hat = {rho_hat:.4f}", flush=True)
        os.makedirs(args.save, exist_ok=True)

    it, best = 0, 0.0
    for epoch in range(args.epochs):
        ulb_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        used = 0.0
        for (u_w, u_s), _ in ulb_loader:
            x, y = next(lb_stream)
            n = x.size(0)
            inputs = torch.cat([x, u_w, u_s]).to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            logits = model(inputs)
            logits_x = logits[:n]
            logits_w, logits_s = logits[n:].chunk(2)

            loss_x = F.cross_entropy(logits_x, y)
            with torch.no_grad():
                p_w = torch.softmax(logits_w / args.T, dim=1)
                pseudo = p_w.argmax(1)
                l_w = F.cross_entropy(logits_w, pseudo, reduction="none")
                mask = (l_w < rho).float()
            loss_u = (F.cross_entropy(logits_s, pseudo, reduction="none") * mask).mean()
            loss = loss_x + loss_u

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            ema.update(model.module)
            used += mask.mean().item()
            it += 1

            if it % args.dash_interval == 0:
                dash_step += 1
                rho = max(args.C * args.gamma ** (-(dash_step - 1)) * rho_hat, args.rho_min)

        acc = evaluate(ema.model, test_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: acc {acc:.2f} rho {rho:.4f} used {used / steps_per_epoch:.3f} "
                  f"loss_x {loss_x.item():.4f} ({time.time() - t0:.0f}s)", flush=True)
            state = {"epoch": epoch + 1, "model": model.module.state_dict(), "ema": ema.model.state_dict(),
                     "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                     "rho": rho, "rho_hat": rho_hat, "acc": acc}
            torch.save(state, os.path.join(args.save, "last.pth"))
            if acc > best:
                best = acc
                torch.save(state, os.path.join(args.save, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
