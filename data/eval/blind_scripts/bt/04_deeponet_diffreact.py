#!/usr/bin/env python3
# DeepONet for the 1D diffusion-reaction system  s_t = D s_xx + k s^2 + u(x)
# (Lu et al., Nat. Mach. Intell. 2021). Branch net sees the source term u at
# m sensors, trunk net sees (x, t).
#
#   torchrun --nproc_per_node=4 04_deeponet_diffreact.py --train data/dr_train.npz \
#       --test data/dr_test.npz --ckpt-dir ckpt/deeponet_dr
#   # continue a run that was stopped by the scheduler:
#   torchrun --nproc_per_node=4 04_deeponet_diffreact.py ... --resume ckpt/deeponet_dr/last.pth
import argparse
import logging
import math
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("deeponet")


def get_parser():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", type=str, required=True)
    parser.add_argument("--test", type=str, required=True)
    parser.add_argument("--ckpt-dir", type=str, default="ckpt/deeponet")
    parser.add_argument("--resume", type=str, default="")
    parser.add_argument("--points-per-sample", type=int, default=200)
    parser.add_argument("--latent", type=int, default=128)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--min-lr", type=float, default=1e-5)
    parser.add_argument("--epochs", type=int, default=2000)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--seed", type=int, default=17)
    return parser


class OperatorDataset(Dataset):
    """Each item: u at the sensors, a random subset of query points (x, t) and s there."""

    def __init__(self, path, points_per_sample=None):
        d = np.load(path)
        self.u = torch.from_numpy(d["u"].astype(np.float32))      # (N, m)
        self.xt = torch.from_numpy(d["xt"].astype(np.float32))    # (P, 2)
        self.s = torch.from_numpy(d["s"].astype(np.float32))      # (N, P)
        self.pps = points_per_sample

    def __len__(self):
        return self.u.shape[0]

    def __getitem__(self, i):
        if self.pps is None:
            return self.u[i], self.xt, self.s[i]
        idx = torch.randint(0, self.xt.shape[0], (self.pps,))
        return self.u[i], self.xt[idx], self.s[i, idx]


def mlp(sizes, act=nn.Tanh):
    layers = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), act()]
    return nn.Sequential(*layers[:-1])


class DeepONet(nn.Module):
    def __init__(self, m_sensors, latent, width, depth):
        super().__init__()
        self.branch = mlp([m_sensors] + [width] * depth + [latent])
        self.trunk = mlp([2] + [width] * depth + [latent])
        self.bias = nn.Parameter(torch.zeros(1))
        for mod in self.modules():
            if isinstance(mod, nn.Linear):
                nn.init.xavier_normal_(mod.weight)
                nn.init.zeros_(mod.bias)

    def forward(self, u, xt):
        # u: (B, m), xt: (B, P, 2) -> (B, P)
        b = self.branch(u)
        t = torch.tanh(self.trunk(xt))
        return torch.einsum("bl,bpl->bp", b, t) + self.bias


def setup():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return dist.get_rank(), dist.get_world_size(), local_rank


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    totals = torch.zeros(3, device=device)
    for u, xt, s in loader:
        u, xt, s = u.to(device), xt.to(device), s.to(device)
        pred = model(u, xt)
        err = torch.linalg.norm(pred - s, dim=1) / torch.linalg.norm(s, dim=1)
        totals[0] += err.sum()
        totals[1] += ((pred - s) ** 2).mean(dim=1).sum()
        totals[2] += u.shape[0]
    dist.all_reduce(totals)
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


def main():
    args = get_parser().parse_args()
    rank, world_size, local_rank = setup()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, stream=sys.stdout,
                        format="%(asctime)s %(levelname)s %(message)s")
    # different query points per rank, same weights everywhere (DDP broadcasts from rank 0)
    torch.manual_seed(args.seed + rank)

    train_set = OperatorDataset(args.train, args.points_per_sample)
    test_set = OperatorDataset(args.test)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    test_shard = Subset(test_set, range(rank, len(test_set), world_size))
    test_loader = DataLoader(test_shard, batch_size=16, shuffle=False, num_workers=2)

    net = DeepONet(train_set.u.shape[1], args.latent, args.width, args.depth).to(device)
    model = DistributedDataParallel(net, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs, eta_min=args.min_lr)
    loss_fn = nn.MSELoss()

    start_epoch, best = 0, math.inf
    if args.resume:
        checkpoint = torch.load(args.resume)
        net.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        start_epoch = checkpoint["epoch"] + 1
        best = checkpoint.get("best", math.inf)
        log.info("resumed %s at epoch %d (best rel. L2 %.4e)", args.resume, start_epoch, best)

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        epoch_loss = torch.zeros(2, device=device)
        for u, xt, s in train_loader:
            u = u.to(device, non_blocking=True)
            xt = xt.to(device, non_blocking=True)
            s = s.to(device, non_blocking=True)
            loss = loss_fn(model(u, xt), s)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            epoch_loss += torch.stack([loss.detach() * u.shape[0], torch.tensor(float(u.shape[0]), device=device)])
        scheduler.step()
        dist.all_reduce(epoch_loss)

        if epoch % args.eval_every == 0 or epoch == args.epochs - 1:
            rel_l2, mse = evaluate(model, test_loader, device)
            log.info("epoch %5d  train mse %.3e  test mse %.3e  test rel L2 %.4e  lr %.2e", epoch,
                     (epoch_loss[0] / epoch_loss[1]).item(), mse, rel_l2, scheduler.get_last_lr()[0])
            if rank == 0:
                state = {"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                         "scheduler": scheduler.state_dict(), "epoch": epoch, "best": min(best, rel_l2),
                         "config": vars(args)}
                torch.save(state, os.path.join(args.ckpt_dir, "last.pth"))
                if rel_l2 < best:
                    torch.save(state, os.path.join(args.ckpt_dir, "best.pth"))
            best = min(best, rel_l2)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
