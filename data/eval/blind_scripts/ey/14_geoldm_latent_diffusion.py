"""GeoLDM-lite: latent diffusion on top of a frozen equivariant autoencoder (QM9 / GEOM).

Stage 2 only: the autoencoder checkpoint from stage 1 is loaded and frozen,
molecules are encoded on the fly and a latent EGNN denoiser is trained.

    torchrun --nproc_per_node=4 14_geoldm_latent_diffusion.py --ae_ckpt /shared/geoldm/ae_qm9.pt \
        --data /shared/geoldm/qm9_dense.pt --run_name ldm_qm9_lat1
"""
import argparse
import os
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def get_parser():
    p = argparse.ArgumentParser("GeoLDM stage 2")
    p.add_argument("--ae_ckpt", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--run_name", default="ldm")
    p.add_argument("--out_dir", default="/shared/geoldm/runs")
    p.add_argument("--latent_nf", type=int, default=1)
    p.add_argument("--nf", type=int, default=256)
    p.add_argument("--n_layers", type=int, default=9)
    p.add_argument("--T", type=int, default=1000)
    p.add_argument("--epochs", type=int, default=3000)
    p.add_argument("--bs", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--ema_decay", type=float, default=0.9999)
    p.add_argument("--val_every", type=int, default=20)
    return p


def com_free(x, nm):
    return (x - (x * nm).sum(1, keepdim=True) / nm.sum(1, keepdim=True)) * nm


class EGCL(nn.Module):
    def __init__(self, nf):
        super().__init__()
        self.e = nn.Sequential(nn.Linear(2 * nf + 1, nf), nn.SiLU(), nn.Linear(nf, nf), nn.SiLU())
        self.n = nn.Sequential(nn.Linear(2 * nf, nf), nn.SiLU(), nn.Linear(nf, nf))
        self.c = nn.Sequential(nn.Linear(nf, nf), nn.SiLU(), nn.Linear(nf, 1, bias=False))

    def forward(self, h, x, nm, em):
        B, N, C = h.shape
        r = x[:, :, None] - x[:, None]
        d2 = r.pow(2).sum(-1, keepdim=True)
        m = self.e(torch.cat([h[:, :, None].expand(B, N, N, C), h[:, None].expand(B, N, N, C), d2], -1)) * em
        h = h + self.n(torch.cat([h, m.sum(2) / 100.0], -1)) * nm
        x = x + (r / (d2.sqrt() + 1) * self.c(m) * em).sum(2) / 100.0 * nm
        return h, x


class EGNN(nn.Module):
    def __init__(self, in_nf, out_nf, nf, n_layers, time_cond=False):
        super().__init__()
        self.time_cond = time_cond
        self.inp = nn.Linear(in_nf + int(time_cond), nf)
        self.layers = nn.ModuleList(EGCL(nf) for _ in range(n_layers))
        self.out = nn.Linear(nf, out_nf)

    def forward(self, x, h, nm, em, t=None):
        if self.time_cond:
            h = torch.cat([h, t[:, None, None].expand(-1, h.shape[1], 1)], -1)
        z = self.inp(h) * nm
        y = x
        for layer in self.layers:
            z, y = layer(z, y, nm, em)
        # denoiser predicts the noise (displacement); the encoder returns latent positions
        return com_free(y - x if self.time_cond else y, nm), self.out(z) * nm


class Encoder(nn.Module):
    """Stage-1 encoder: (x, one-hot) -> (z_x, z_h) mean; frozen here."""

    def __init__(self, n_types, latent_nf, nf=256, n_layers=1):
        super().__init__()
        self.net = EGNN(n_types, latent_nf, nf, n_layers)

    def forward(self, x, onehot, nm, em):
        return self.net(x, onehot, nm, em)


def edge_mask(nm):
    m = nm.squeeze(-1)
    em = m[:, :, None] * m[:, None, :]
    em = em * (1 - torch.eye(m.shape[1], device=m.device))
    return em.unsqueeze(-1)


def cosine_a2(T, device):
    s = 0.008
    steps = torch.arange(T + 1, device=device, dtype=torch.float64) / T
    f = torch.cos((steps + s) / (1 + s) * math.pi / 2) ** 2
    return (f / f[0]).clamp(1e-5, 1 - 1e-5).float()


def latent_loss(denoiser, encoder, batch, a2, T):
    x, onehot, nm = batch
    nm = nm.unsqueeze(-1).float()
    em = edge_mask(nm)
    with torch.no_grad():
        zx, zh = encoder(com_free(x, nm), onehot, nm, em)
    B = x.shape[0]
    t = torch.randint(1, T + 1, (B,), device=x.device)
    a = a2[t].view(B, 1, 1)
    ex, eh = com_free(torch.randn_like(zx), nm), torch.randn_like(zh) * nm
    px, ph = denoiser(a.sqrt() * zx + (1 - a).sqrt() * ex, a.sqrt() * zh + (1 - a).sqrt() * eh, nm, em, t.float() / T)
    return (((px - ex) ** 2).sum((1, 2)) + ((ph - eh) ** 2).sum((1, 2))).div(nm.sum((1, 2))).mean()


def main():
    args = get_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    wandb.init(project="geoldm", name=args.run_name, config=vars(args), dir=args.out_dir)

    d = torch.load(args.data, map_location="cpu")
    train_ds = TensorDataset(d["train"]["x"], d["train"]["one_hot"].float(), d["train"]["mask"])
    val_ds = TensorDataset(d["val"]["x"], d["val"]["one_hot"].float(), d["val"]["mask"])
    n_types = train_ds.tensors[1].shape[-1]
    tr_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    va_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    tr_loader = DataLoader(train_ds, batch_size=args.bs, sampler=tr_sampler, num_workers=4, pin_memory=True)
    va_loader = DataLoader(val_ds, batch_size=args.bs, sampler=va_sampler, num_workers=2)

    ae_state = torch.load(args.ae_ckpt, map_location=device)
    encoder = Encoder(n_types, args.latent_nf).to(device)
    encoder.load_state_dict(ae_state["encoder"])
    encoder.eval().requires_grad_(False)

    denoiser = EGNN(args.latent_nf, args.latent_nf, args.nf, args.n_layers, time_cond=True).to(device)
    ema = EGNN(args.latent_nf, args.latent_nf, args.nf, args.n_layers, time_cond=True).to(device)
    ema.load_state_dict(denoiser.state_dict())
    ema.requires_grad_(False)
    model = DDP(denoiser, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, amsgrad=True, weight_decay=1e-12)
    a2 = cosine_a2(args.T, device)

    run_dir = os.path.join(args.out_dir, args.run_name)
    if rank == 0:
        os.makedirs(run_dir, exist_ok=True)

    step = 0
    best = float("inf")
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        ep_loss = torch.zeros(2, device=device)
        for batch in tr_loader:
            batch = [b.to(device, non_blocking=True) for b in batch]
            loss = latent_loss(model, encoder, batch, a2, args.T)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            with torch.no_grad():
                for pe, p in zip(ema.parameters(), denoiser.parameters()):
                    pe.mul_(args.ema_decay).add_(p, alpha=1 - args.ema_decay)
            ep_loss += torch.stack([loss.detach(), torch.ones((), device=device)])
            step += 1

        dist.all_reduce(ep_loss)
        wandb.log({"train/loss": (ep_loss[0] / ep_loss[1]).item(), "epoch": epoch}, step=step)

        if epoch % args.val_every == 0:
            ema.eval()
            acc = torch.zeros(2, device=device)
            with torch.no_grad():
                for batch in va_loader:
                    batch = [b.to(device) for b in batch]
                    acc += torch.stack([latent_loss(ema, encoder, batch, a2, args.T) * batch[0].shape[0],
                                        torch.tensor(float(batch[0].shape[0]), device=device)])
            dist.all_reduce(acc)
            val = (acc[0] / acc[1]).item()
            wandb.log({"val/loss_ema": val}, step=step)
            if rank == 0 and val < best:
                best = val
                torch.save({"denoiser": denoiser.state_dict(), "ema": ema.state_dict(), "epoch": epoch},
                           os.path.join(run_dir, "best.pt"))

        if rank == 0:
            torch.save({"denoiser": denoiser.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(),
                        "epoch": epoch}, os.path.join(run_dir, "last.pt"))
        dist.barrier()

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
