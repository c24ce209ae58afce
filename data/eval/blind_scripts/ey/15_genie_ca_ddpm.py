"""Genie-lite: DDPM over C-alpha coordinates with an EGNN + pair-feature denoiser.

Training on SCOPe domains (<=128 residues). After training, rank 0..N-1 each
sample backbones from the best checkpoint (raw and EMA weights) and we report
CA-CA geometry, radius of gyration and mean pairwise RMSD (diversity).

    torchrun --nproc_per_node=8 15_genie_ca_ddpm.py --data /shared/scope/ca_l128.pt --out /shared/runs/genie_lite
"""
import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

L_MAX = 128


def args_():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=400)
    p.add_argument("--bs", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--T", type=int, default=1000)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--val_every", type=int, default=10)
    p.add_argument("--final_samples", type=int, default=64, help="per rank")
    return p.parse_args()


def mcenter(x, m):
    w = m[..., None]
    return (x - (x * w).sum(1, keepdim=True) / w.sum(1, keepdim=True)) * w


class Layer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.pair = nn.Sequential(nn.Linear(2 * d + 1 + 32, d), nn.SiLU(), nn.Linear(d, d), nn.SiLU())
        self.node = nn.Sequential(nn.LayerNorm(2 * d), nn.Linear(2 * d, d), nn.SiLU(), nn.Linear(d, d))
        self.xw = nn.Sequential(nn.Linear(d, d), nn.SiLU(), nn.Linear(d, 1))

    def forward(self, h, x, rel, m):
        B, L, D = h.shape
        r = x[:, :, None] - x[:, None]
        d2 = r.pow(2).sum(-1, keepdim=True)
        em = (m[:, :, None] * m[:, None]).unsqueeze(-1)
        e = self.pair(torch.cat([h[:, :, None].expand(B, L, L, D), h[:, None].expand(B, L, L, D), d2,
                                 rel.expand(B, L, L, -1)], -1)) * em
        deg = em.sum(2).clamp(min=1)
        h = h + self.node(torch.cat([h, e.sum(2) / deg], -1)) * m[..., None]
        x = x + (r / (d2.sqrt() + 1) * self.xw(e) * em).sum(2) / deg
        return h, mcenter(x, m)


class Denoiser(nn.Module):
    def __init__(self, d, depth):
        super().__init__()
        self.t_emb = nn.Sequential(nn.Linear(32, d), nn.SiLU(), nn.Linear(d, d))
        self.rel = nn.Embedding(2 * 16 + 1, 32)
        self.layers = nn.ModuleList(Layer(d) for _ in range(depth))

    def forward(self, x_t, t, m):
        B, L, _ = x_t.shape
        f = torch.exp(-math.log(10000) * torch.arange(16, device=t.device) / 16)
        te = torch.cat([(t[:, None] * f).sin(), (t[:, None] * f).cos()], -1)
        h = self.t_emb(te)[:, None].expand(B, L, -1) * m[..., None]
        i = torch.arange(L, device=t.device)
        rel = self.rel((i[None] - i[:, None]).clamp(-16, 16) + 16)[None]
        x = x_t
        for layer in self.layers:
            h, x = layer(h, x, rel, m)
        return mcenter(x - x_t, m)


def betas_cosine(T):
    s = 0.008
    steps = torch.arange(T + 1, dtype=torch.float64) / T
    ac = torch.cos((steps + s) / (1 + s) * math.pi / 2) ** 2
    ac = ac / ac[0]
    return (1 - ac[1:] / ac[:-1]).clamp(max=0.999).float()


class DDPM:
    def __init__(self, T, device):
        self.T = T
        self.betas = betas_cosine(T).to(device)
        self.alphas = 1 - self.betas
        self.ab = torch.cumprod(self.alphas, 0)

    def loss(self, model, x0, m):
        t = torch.randint(0, self.T, (x0.shape[0],), device=x0.device)
        eps = mcenter(torch.randn_like(x0), m)
        ab = self.ab[t][:, None, None]
        xt = ab.sqrt() * x0 + (1 - ab).sqrt() * eps
        pred = model(xt, t.float(), m)
        return (((pred - eps) ** 2).sum(-1) * m).sum() / (m.sum() * 3)

    @torch.no_grad()
    def sample(self, model, m):
        x = mcenter(torch.randn(*m.shape, 3, device=m.device), m)
        for t in reversed(range(self.T)):
            tt = torch.full((m.shape[0],), float(t), device=m.device)
            eps = model(x, tt, m)
            x = (x - self.betas[t] / (1 - self.ab[t]).sqrt() * eps) / self.alphas[t].sqrt()
            if t > 0:
                x = x + self.betas[t].sqrt() * mcenter(torch.randn_like(x), m)
        return x


def kabsch_rmsd(a, b):
    a, b = a - a.mean(0), b - b.mean(0)
    U, _, Vt = torch.linalg.svd(a.T @ b)
    s = torch.sign(torch.linalg.det(U @ Vt))
    D = torch.diag(torch.stack([torch.ones_like(s), torch.ones_like(s), s]))
    return ((a @ U @ D @ Vt - b) ** 2).sum(-1).mean().sqrt()


def sample_metrics(x, m):
    x = x * 10.0
    bond = (x[:, 1:] - x[:, :-1]).norm(dim=-1)
    bm = m[:, 1:] * m[:, :-1]
    rg = ((x ** 2).sum(-1) * m).sum(1).div(m.sum(1)).sqrt()
    n = m.sum(1).long()
    rmsds = [kabsch_rmsd(x[i, :min(n[i], n[j])], x[j, :min(n[i], n[j])])
             for i in range(len(x)) for j in range(i + 1, len(x))]
    return torch.stack([((bond - 3.8).abs() * bm).sum(), bm.sum(), rg.sum(), torch.tensor(float(len(x)), device=x.device),
                        torch.stack(rmsds).sum(), torch.tensor(float(len(rmsds)), device=x.device)])


def main():
    args = args_()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    blob = torch.load(args.data, map_location="cpu")
    tr = TensorDataset(blob["train_x"] / 10.0, blob["train_mask"].float())
    va = TensorDataset(blob["val_x"] / 10.0, blob["val_mask"].float())
    tr_s = DistributedSampler(tr, shuffle=True, drop_last=True)
    va_s = DistributedSampler(va, shuffle=False, drop_last=True)
    tr_dl = DataLoader(tr, batch_size=args.bs, sampler=tr_s, num_workers=4, pin_memory=True)
    va_dl = DataLoader(va, batch_size=args.bs, sampler=va_s, num_workers=2)

    net = Denoiser(args.d, args.depth).to(dev)
    model = DDP(net, device_ids=[local_rank])
    ema = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.999))
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    ddpm = DDPM(args.T, dev)
    os.makedirs(args.out, exist_ok=True)
    best_path = os.path.join(args.out, "best.pt")

    best = float("inf")
    for epoch in range(args.epochs):
        tr_s.set_epoch(epoch)
        model.train()
        for x, m in tr_dl:
            x, m = x.to(dev), m.to(dev)
            loss = ddpm.loss(model, mcenter(x, m), m)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            ema.update_parameters(net)

        if (epoch + 1) % args.val_every == 0:
            acc = torch.zeros(2, device=dev)
            with torch.no_grad():
                for x, m in va_dl:
                    x, m = x.to(dev), m.to(dev)
                    acc += torch.stack([ddpm.loss(ema.module, mcenter(x, m), m) * len(x),
                                        torch.tensor(float(len(x)), device=dev)])
            dist.all_reduce(acc)
            val = (acc[0] / acc[1]).item()
            if rank == 0:
                print(f"epoch {epoch}: val {val:.4f}", flush=True)
                if val < best:
                    best = val
                    torch.save({"model": model.state_dict(), "ema": ema.module.state_dict(), "epoch": epoch,
                                "val": val}, best_path)
            dist.barrier()

    # final sampling from the best checkpoint, split across ranks
    ck = torch.load(best_path, map_location=dev)
    lengths = torch.linspace(50, L_MAX, args.final_samples).long().to(dev)
    m = (torch.arange(L_MAX, device=dev)[None] < lengths[:, None]).float()
    torch.manual_seed(rank)
    for key in ("model", "ema"):
        sampler_net = Denoiser(args.d, args.depth).to(dev).eval()
        sampler_net.load_state_dict(ck[key])
        res = sample_metrics(ddpm.sample(sampler_net, m), m)
        dist.all_reduce(res)
        if rank == 0:
            print(f"[{key}] CA-CA dev {res[0] / res[1]:.3f} A | Rg {res[2] / res[3]:.2f} A | "
                  f"mean pairwise RMSD (within rank) {res[4] / res[5]:.2f} A", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
