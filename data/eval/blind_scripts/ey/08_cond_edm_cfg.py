# Property-conditioned EDM on QM9 with classifier-free guidance.
# Conditioning on one of (alpha, gap, homo, lumo, mu, Cv); the property is
# dropped with probability p_uncond so one network learns both the conditional
# and unconditional score.
#
#   torchrun --nproc_per_node=4 08_cond_edm_cfg.py --prop alpha --data /datasets/qm9/qm9_edm_splits.pt
import os
import sys
import time
import json
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

PROPS = ["alpha", "gap", "homo", "lumo", "mu", "Cv"]


def parse_args(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--prop", choices=PROPS, default="alpha")
    ap.add_argument("--exp_dir", default="/shared/runs/cond_edm")
    ap.add_argument("--n_epochs", type=int, default=1500)
    ap.add_argument("--batch_size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--nf", type=int, default=192)
    ap.add_argument("--n_layers", type=int, default=9)
    ap.add_argument("--T", type=int, default=1000)
    ap.add_argument("--p_uncond", type=float, default=0.1)
    ap.add_argument("--ema_decay", type=float, default=0.9999)
    ap.add_argument("--test_epochs", type=int, default=10)
    return ap.parse_args(argv)


def load_split(blob, split, prop):
    d = blob[split]
    return TensorDataset(d["positions"].float(), d["one_hot"].float(), d["atom_mask"].bool(),
                         d[prop].float().view(-1, 1))


class GCL(nn.Module):
    def __init__(self, nf):
        super().__init__()
        self.edge_mlp = nn.Sequential(nn.Linear(2 * nf + 1, nf), nn.SiLU(), nn.Linear(nf, nf), nn.SiLU())
        self.node_mlp = nn.Sequential(nn.Linear(2 * nf, nf), nn.SiLU(), nn.Linear(nf, nf))
        self.coord_mlp = nn.Sequential(nn.Linear(nf, nf), nn.SiLU(), nn.Linear(nf, 1, bias=False))

    def forward(self, h, x, nmask, emask):
        B, N, C = h.shape
        rij = x[:, :, None, :] - x[:, None, :, :]
        d2 = (rij ** 2).sum(-1, keepdim=True)
        e = self.edge_mlp(torch.cat([h[:, :, None].expand(B, N, N, C), h[:, None].expand(B, N, N, C), d2], -1))
        e = e * emask
        h = h + self.node_mlp(torch.cat([h, e.sum(2) / 100.0], -1)) * nmask
        x = x + (rij / (d2 + 1e-8).sqrt().add(1.0) * self.coord_mlp(e) * emask).sum(2) / 100.0 * nmask
        return h, x


class CondEGNN(nn.Module):
    def __init__(self, in_nf, nf, n_layers):
        super().__init__()
        self.embedding = nn.Linear(in_nf + 1, nf)
        self.cond_mlp = nn.Sequential(nn.Linear(1, nf), nn.SiLU(), nn.Linear(nf, nf))
        self.gcls = nn.ModuleList([GCL(nf) for _ in range(n_layers)])
        self.embedding_out = nn.Linear(nf, in_nf)

    def forward(self, x, h, t, nmask, emask, context=None):
        z = self.embedding(torch.cat([h, t[:, None, None].expand(-1, h.shape[1], 1)], -1))
        if context is not None:
            z = z + self.cond_mlp(context)[:, None, :]
        z = z * nmask
        xx = x
        for gcl in self.gcls:
            z, xx = gcl(z, xx, nmask, emask)
        vel = (xx - x) * nmask
        vel = vel - (vel.sum(1, keepdim=True) / nmask.sum(1, keepdim=True)) * nmask
        return vel, self.embedding_out(z) * nmask


def masks(atom_mask):
    nmask = atom_mask.unsqueeze(-1).float()
    emask = (atom_mask[:, :, None] & atom_mask[:, None, :]).float()
    emask = emask * (1 - torch.eye(atom_mask.shape[1], device=atom_mask.device))
    return nmask, emask.unsqueeze(-1)


def sub_com(x, nmask):
    return (x - (x * nmask).sum(1, keepdim=True) / nmask.sum(1, keepdim=True)) * nmask


def gamma_schedule(T, device, s=1e-5, power=2):
    t = torch.linspace(0, 1, T + 1, device=device)
    alphas2 = (1 - t ** power) ** 2
    alphas2 = (1 - 2 * s) * alphas2 + s
    return alphas2


def compute_loss(model, batch, alphas2, T, p_uncond, prop_mean, prop_std, train=True):
    x, one_hot, atom_mask, y = batch
    nmask, emask = masks(atom_mask)
    x = sub_com(x, nmask)
    h = one_hot * 0.25 * nmask
    B = x.shape[0]
    t = torch.randint(0 if train else 1, T + 1, (B,), device=x.device)
    a2 = alphas2[t].view(B, 1, 1)
    eps_x = sub_com(torch.randn_like(x), nmask)
    eps_h = torch.randn_like(h) * nmask
    z_x = a2.sqrt() * x + (1 - a2).sqrt() * eps_x
    z_h = a2.sqrt() * h + (1 - a2).sqrt() * eps_h
    context = (y - prop_mean) / prop_std
    if train and torch.rand(()) < p_uncond:
        context = None
    px, ph = model(z_x, z_h, t.float() / T, nmask, emask, context=context)
    err = ((px - eps_x) ** 2).sum((1, 2)) + ((ph - eps_h) ** 2).sum((1, 2))
    return (err / (nmask.sum((1, 2)) * (3 + h.shape[-1]))).mean()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    is_main = rank == 0

    blob = torch.load(args.data, map_location="cpu")
    train_ds = load_split(blob, "train", args.prop)
    valid_ds = load_split(blob, "valid", args.prop)
    prop_mean = train_ds.tensors[3].mean().to(device)
    prop_std = train_ds.tensors[3].std().to(device)
    in_nf = train_ds.tensors[1].shape[-1]

    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    valid_sampler = DistributedSampler(valid_ds, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=2, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid_ds, batch_size=args.batch_size, sampler=valid_sampler, num_workers=2)

    model = CondEGNN(in_nf, args.nf, args.n_layers).to(device)
    model_ema = CondEGNN(in_nf, args.nf, args.n_layers).to(device)
    model_ema.load_state_dict(model.state_dict())
    for p in model_ema.parameters():
        p.requires_grad_(False)
    model_dp = DDP(model, device_ids=[local_rank])
    optim = torch.optim.AdamW(model_dp.parameters(), lr=args.lr, amsgrad=True, weight_decay=1e-12)
    alphas2 = gamma_schedule(args.T, device)

    exp_dir = os.path.join(args.exp_dir, args.prop)
    if is_main:
        os.makedirs(exp_dir, exist_ok=True)
        with open(os.path.join(exp_dir, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=1)
        print(" ".join(sys.argv), flush=True)

    best_nll = 1e9
    for epoch in range(args.n_epochs):
        train_sampler.set_epoch(epoch)
        model_dp.train()
        t_start = time.time()
        for i, batch in enumerate(train_loader):
            batch = [b.to(device, non_blocking=True) for b in batch]
            loss = compute_loss(model_dp, batch, alphas2, args.T, args.p_uncond, prop_mean, prop_std)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model_dp.parameters(), max_norm=1.0)
            optim.step()
            with torch.no_grad():
                for p_ema, p in zip(model_ema.parameters(), model.parameters()):
                    p_ema.data.mul_(args.ema_decay).add_(p.data, alpha=1 - args.ema_decay)
            if is_main and i % 100 == 0:
                print(f"Epoch {epoch} it {i}/{len(train_loader)} loss {loss.item():.4f} "
                      f"({time.time() - t_start:.1f}s)", flush=True)

        if epoch % args.test_epochs == 0:
            model_ema.eval()
            acc = torch.zeros(2, device=device)
            with torch.no_grad():
                for batch in valid_loader:
                    batch = [b.to(device) for b in batch]
                    l = compute_loss(model_ema, batch, alphas2, args.T, 0.0, prop_mean, prop_std, train=False)
                    acc += torch.stack([l * batch[0].shape[0], torch.tensor(float(batch[0].shape[0]), device=device)])
            dist.all_reduce(acc)
            val_nll = (acc[0] / acc[1]).item()
            if is_main:
                print(f"Epoch {epoch} val loss (EMA) {val_nll:.5f}", flush=True)
                state = {"model": model.state_dict(), "model_ema": model_ema.state_dict(),
                         "optim": optim.state_dict(), "epoch": epoch,
                         "prop_mean": prop_mean.item(), "prop_std": prop_std.item()}
                torch.save(state, os.path.join(exp_dir, "generative_model_last.pt"))
                if val_nll < best_nll:
                    best_nll = val_nll
                    torch.save(state, os.path.join(exp_dir, "generative_model_best.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
