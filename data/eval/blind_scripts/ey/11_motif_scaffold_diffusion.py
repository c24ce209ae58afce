"""RFdiffusion-lite: motif-scaffolding diffusion over CA coordinates.

A random contiguous motif (or two) is kept fixed; the network denoises the
scaffold around it. Evaluation samples scaffolds for held-out motifs and
reports the CA RMSD to the native chain after Kabsch alignment plus CA-CA
bond geometry of the generated scaffold.

    torchrun --nproc_per_node=8 11_motif_scaffold_diffusion.py --data data/scaffold_ca.pt \
        --workdir /shared/motif_runs/v2 --resume /shared/motif_runs/v2/ckpt_latest.pt
"""
import argparse
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

MAXLEN = 200


class ScaffoldSet(Dataset):
    def __init__(self, chains, train=True):
        self.chains = chains
        self.train = train

    def __len__(self):
        return len(self.chains)

    def __getitem__(self, idx):
        rng = random.Random(None if self.train else idx)
        ca = self.chains[idx][:MAXLEN].float()
        L = ca.shape[0]
        motif = torch.zeros(MAXLEN, dtype=torch.bool)
        for _ in range(rng.randint(1, 2)):
            ml = rng.randint(5, 20)
            s = rng.randint(0, L - ml)
            motif[s:s + ml] = True
        x = torch.zeros(MAXLEN, 3)
        mask = torch.zeros(MAXLEN, dtype=torch.bool)
        c = ca[motif[:L]].mean(0)
        x[:L] = (ca - c) / 10.0
        mask[:L] = True
        return x, mask, motif & mask


class TriBlock(nn.Module):
    def __init__(self, d, dp):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.pb = nn.Linear(dp, 1)
        self.o = nn.Linear(d, d)
        self.ff = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d))
        self.pair_upd = nn.Sequential(nn.Linear(2 * d + dp, dp), nn.ReLU(), nn.Linear(dp, dp))
        self.x_w = nn.Linear(dp, 1)

    def forward(self, s, z, x, mask, free):
        y = self.norm(s)
        a = torch.einsum("bid,bjd->bij", self.q(y), self.k(y)) / y.shape[-1] ** 0.5 + self.pb(z).squeeze(-1)
        a = a.masked_fill(~mask[:, None, :], float("-inf")).softmax(-1)
        s = s + self.o(a @ self.v(y))
        s = s + self.ff(s)
        L = s.shape[1]
        z = z + self.pair_upd(torch.cat([s[:, :, None].expand(-1, -1, L, -1),
                                         s[:, None].expand(-1, L, -1, -1), z], -1))
        diff = x[:, :, None] - x[:, None]
        w = self.x_w(z) * (mask[:, :, None] & mask[:, None, :]).unsqueeze(-1)
        x = x + (diff / (diff.norm(dim=-1, keepdim=True) + 1) * w).mean(2) * free[..., None]
        return s, z, x


class MotifDenoiser(nn.Module):
    def __init__(self, d=192, dp=64, depth=8):
        super().__init__()
        self.s_in = nn.Linear(2 + 1, d)
        self.relpos = nn.Embedding(65, dp)
        self.dist_in = nn.Linear(16, dp)
        self.blocks = nn.ModuleList([TriBlock(d, dp) for _ in range(depth)])

    def forward(self, x_t, t, mask, motif):
        B, L, _ = x_t.shape
        free = (mask & ~motif).float()
        s = self.s_in(torch.stack([motif.float(), mask.float(), t[:, None].expand(B, L)], -1))
        idx = torch.arange(L, device=x_t.device)
        rp = (idx[None] - idx[:, None]).clamp(-32, 32) + 32
        dm = torch.cdist(x_t, x_t)
        motif_pair = (motif[:, :, None] & motif[:, None]).float()
        rbf = torch.exp(-((dm[..., None] - torch.linspace(0, 2, 16, device=x_t.device)) ** 2) / 0.02)
        z = self.relpos(rp)[None] + self.dist_in(rbf * motif_pair[..., None])
        x = x_t
        for blk in self.blocks:
            s, z, x = blk(s, z, x, mask, free)
        return x  # predicts x0


def noise(x0, mask, motif, t):
    ab = torch.cos(t * torch.pi / 2) ** 2
    eps = torch.randn_like(x0)
    xt = ab.sqrt()[:, None, None] * x0 + (1 - ab).sqrt()[:, None, None] * eps
    keep = motif[..., None]
    return torch.where(keep, x0, xt) * mask[..., None]


def loss_fn(model, x0, mask, motif):
    t = torch.rand(x0.shape[0], device=x0.device).clamp(min=1e-3)
    x_hat = model(noise(x0, mask, motif, t), t, mask, motif)
    w = (mask & ~motif).float()
    return (((x_hat - x0) ** 2).sum(-1) * w).sum() / w.sum().clamp(min=1)


@torch.no_grad()
def sample(model, x_motif, mask, motif, steps=100):
    x = torch.where(motif[..., None], x_motif, torch.randn_like(x_motif)) * mask[..., None]
    ts = torch.linspace(1, 0, steps + 1, device=x.device)
    for i in range(steps):
        t, t_next = ts[i].expand(x.shape[0]), ts[i + 1]
        x0_hat = model(x, t, mask, motif)
        x = noise(x0_hat, mask, motif, t_next.expand(x.shape[0])) if i < steps - 1 else x0_hat
        x = torch.where(motif[..., None], x_motif, x)
    return x


def kabsch_rmsd(pred, ref, sel):
    P, Q = pred[sel] * 10, ref[sel] * 10
    P, Q = P - P.mean(0), Q - Q.mean(0)
    U, _, Vt = torch.linalg.svd(P.T @ Q)
    sgn = torch.sign(torch.linalg.det(U @ Vt))
    U = U.clone()
    U[:, -1] *= sgn
    return ((P @ (U @ Vt) - Q) ** 2).sum(-1).mean().sqrt()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--epochs", type=int, default=150)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--ema", type=float, default=0.999)
    ap.add_argument("--n_eval", type=int, default=128)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    blob = torch.load(args.data, map_location="cpu")  # {"train": [L,3] tensors, "test": [...]}
    train_ds = ScaffoldSet(blob["train"], train=True)
    eval_ds = ScaffoldSet(blob["test"][: args.n_eval], train=False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch, sampler=sampler, num_workers=6, drop_last=True)
    eval_loader = DataLoader(Subset(eval_ds, list(range(rank, len(eval_ds), world))), batch_size=16)

    net = MotifDenoiser().to(device)
    ema = MotifDenoiser().to(device).eval().requires_grad_(False)
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr)
    start = 0
    if args.resume and os.path.exists(args.resume):
        ckpt = torch.load(args.resume)
        net.load_state_dict(ckpt["model"])
        ema.load_state_dict(ckpt["ema"])
        opt.load_state_dict(ckpt["opt"])
        start = ckpt["epoch"] + 1
    else:
        ema.load_state_dict(net.state_dict())
    model = DDP(net, device_ids=[local_rank])

    tb = None
    if rank == 0:
        os.makedirs(args.workdir, exist_ok=True)
        tb = SummaryWriter(os.path.join(args.workdir, "tb"))
    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        net.train()
        tic = time.time()
        for it, (x, mask, motif) in enumerate(loader):
            x, mask, motif = x.to(device), mask.to(device), motif.to(device)
            loss = loss_fn(model, x, mask, motif)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            with torch.no_grad():
                for pe, p in zip(ema.parameters(), net.parameters()):
                    pe.lerp_(p, 1 - args.ema)
            if tb is not None and it % 50 == 0:
                tb.add_scalar("loss/train", loss.item(), epoch * len(loader) + it)

        if epoch % 5 == 0 or epoch == args.epochs - 1:
            tot = torch.zeros(5, device=device)
            for x, mask, motif in eval_loader:
                x, mask, motif = x.to(device), mask.to(device), motif.to(device)
                xs = sample(ema, x, mask, motif)
                bond = (xs[:, 1:] - xs[:, :-1]).norm(dim=-1) * 10
                bm = (mask[:, 1:] & mask[:, :-1]).float()
                tot[3] += ((bond - 3.8).abs() * bm).sum()
                tot[4] += bm.sum()
                for b in range(x.shape[0]):
                    r = kabsch_rmsd(xs[b], x[b], mask[b])
                    tot[:3] += torch.stack([r, (r < 2.0).float(), torch.ones((), device=device)])
            dist.all_reduce(tot)
            if rank == 0:
                tb.add_scalar("eval/ca_rmsd", (tot[0] / tot[2]).item(), epoch)
                tb.add_scalar("eval/rmsd_lt2", (tot[1] / tot[2]).item(), epoch)
                tb.add_scalar("eval/ca_bond_dev", (tot[3] / tot[4]).item(), epoch)
                print(f"ep {epoch} CA RMSD {(tot[0] / tot[2]).item():.2f} A "
                      f"<2A {(tot[1] / tot[2]).item():.2%} ({time.time() - tic:.0f}s)", flush=True)

        if rank == 0:
            torch.save({"model": net.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(),
                        "epoch": epoch}, os.path.join(args.workdir, "ckpt_latest.pt"))
        dist.barrier()

    if tb is not None:
        tb.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
