"""DeepONet for the 1D diffusion-reaction equation  s_t = D s_xx + k s^2 + u(x).

Operator: source term u(x) (sampled at m sensors)  ->  solution s(x, t).
Data file (HDF5): u [N, m], s [N, Nx, Nt], x [Nx], t [Nt].

Multi-GPU:
    torchrun --nproc_per_node=4 04_deeponet_diffreact.py --data data/dr_N5000.h5 --out runs/dr
Resume:
    torchrun --nproc_per_node=4 04_deeponet_diffreact.py --data data/dr_N5000.h5 --out runs/dr --resume runs/dr/last.pt
"""
import argparse
import logging
import os

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("deeponet")


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/deeponet_dr")
    ap.add_argument("--n-train", type=int, default=4000)
    ap.add_argument("--points-per-fn", type=int, default=200, help="query points sampled per function per step")
    ap.add_argument("--p", type=int, default=128, help="latent basis size")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--resume", default=None)
    return ap.parse_args()


class OperatorData(Dataset):
    def __init__(self, path, idx, points_per_fn=None, seed=0):
        with h5py.File(path, "r") as f:
            self.u = torch.from_numpy(f["u"][idx[0]:idx[1]].astype(np.float32))
            self.s = torch.from_numpy(f["s"][idx[0]:idx[1]].astype(np.float32))
            x = torch.from_numpy(f["x"][:].astype(np.float32))
            t = torch.from_numpy(f["t"][:].astype(np.float32))
        X, T = torch.meshgrid(x, t, indexing="ij")
        self.coords = torch.stack([X.reshape(-1), T.reshape(-1)], dim=-1)  # [Nx*Nt, 2]
        self.s = self.s.reshape(self.s.shape[0], -1)
        self.points_per_fn = points_per_fn

    def __len__(self):
        return self.u.shape[0]

    def __getitem__(self, i):
        if self.points_per_fn is None:
            return self.u[i], self.coords, self.s[i]
        sel = torch.randint(0, self.coords.shape[0], (self.points_per_fn,))
        return self.u[i], self.coords[sel], self.s[i, sel]


def mlp(din, hidden, dout, depth, act=nn.Tanh):
    layers, d = [], din
    for _ in range(depth - 1):
        layers += [nn.Linear(d, hidden), act()]
        d = hidden
    layers.append(nn.Linear(d, dout))
    return nn.Sequential(*layers)


class DeepONet(nn.Module):
    def __init__(self, m, p, hidden, depth):
        super().__init__()
        self.branch = mlp(m, hidden, p, depth, act=nn.ReLU)
        self.trunk = mlp(2, hidden, p, depth)
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, u, y):
        # u: [B, m], y: [B, P, 2] -> [B, P]
        b = self.branch(u)
        t = torch.tanh(self.trunk(y))
        return torch.einsum("bp,bnp->bn", b, t) + self.bias


def load_checkpoint(path, model, opt=None, sched=None):
    ckpt = torch.load(path)
    model.load_state_dict(ckpt["model"])
    if opt is not None:
        opt.load_state_dict(ckpt["opt"])
    if sched is not None:
        sched.load_state_dict(ckpt["sched"])
    return ckpt.get("epoch", -1) + 1, ckpt.get("best", float("inf"))


def save_checkpoint(path, model, opt, sched, epoch, best):
    tmp = path + ".tmp"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                "epoch": epoch, "best": best}, tmp)
    os.replace(tmp, path)


@torch.no_grad()
def evaluate(model, loader, device, chunk=4096):
    num = torch.zeros((), device=device)
    den = torch.zeros((), device=device)
    for u, y, s in loader:
        u, y, s = u.to(device), y.to(device), s.to(device)
        preds = [model(u, y[:, j:j + chunk]) for j in range(0, y.shape[1], chunk)]
        pred = torch.cat(preds, dim=1)
        num += ((pred - s).norm(dim=1) / s.norm(dim=1)).sum()
        den += u.shape[0]
    dist.all_reduce(num)
    dist.all_reduce(den)
    return (num / den).item()


def main():
    args = parse()
    dist.init_process_group(backend="nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    with h5py.File(args.data, "r") as f:
        n_total, m = f["u"].shape
    train_ds = OperatorData(args.data, (0, args.n_train), points_per_fn=args.points_per_fn)
    test_ds = OperatorData(args.data, (args.n_train, n_total))
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=42)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    test_idx = list(range(rank, len(test_ds), world))
    test_loader = DataLoader(torch.utils.data.Subset(test_ds, test_idx), batch_size=16)

    torch.manual_seed(0)
    net = DeepONet(m, args.p, args.hidden, args.depth).to(device)
    opt = torch.optim.Adam(net.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs, eta_min=1e-5)

    start_epoch, best = 0, float("inf")
    if args.resume:
        start_epoch, best = load_checkpoint(args.resume, net, opt, sched)
        log.info("resumed from %s at epoch %d (best rel-L2 %.4e)", args.resume, start_epoch, best)

    model = DistributedDataParallel(net, device_ids=[local_rank])
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tot = torch.zeros(2, device=device)
        for u, y, s in train_loader:
            u, y, s = u.to(device, non_blocking=True), y.to(device, non_blocking=True), s.to(device, non_blocking=True)
            loss = torch.mean((model(u, y) - s) ** 2)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += torch.stack([loss.detach() * u.shape[0], torch.tensor(float(u.shape[0]), device=device)])
        sched.step()
        dist.all_reduce(tot)
        msg = f"epoch {epoch:4d} train mse {(tot[0] / tot[1]).item():.4e}"

        if (epoch + 1) % args.eval_every == 0:
            model.eval()
            rel = evaluate(net, test_loader, device)
            msg += f" | test rel-L2 {rel:.4e}"
            if rank == 0 and rel < best:
                best = rel
                save_checkpoint(os.path.join(args.out, "best.pt"), net, opt, sched, epoch, best)
        if rank == 0:
            save_checkpoint(os.path.join(args.out, "last.pt"), net, opt, sched, epoch, best)
        log.info(msg)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
