"""EDM (dense, padded) on QM9 with sample-based model selection.

Every --sample_every epochs we draw --n_samples molecules with the EMA weights,
spread over all GPUs, and keep the checkpoint with the best validity x uniqueness.

    torchrun --nproc_per_node=8 20_edm_sample_select.py --data /shared/qm9/edm_qm9.npz --out /shared/runs/edm_sel
"""
import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from rdkit import Chem, RDLogger
from rdkit.Chem import rdDetermineBonds
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

RDLogger.DisableLog("rdApp.*")
SYMBOLS = ["H", "C", "N", "O", "F"]
NMAX = 29


def cli():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=1200)
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--nf", type=int, default=256)
    ap.add_argument("--layers", type=int, default=9)
    ap.add_argument("--T", type=int, default=500)
    ap.add_argument("--ema", type=float, default=0.999)
    ap.add_argument("--sample_every", type=int, default=30)
    ap.add_argument("--n_samples", type=int, default=2048)
    return ap.parse_args()


def masked_mean_free(x, nm):
    return (x - (x * nm).sum(1, keepdim=True) / nm.sum(1, keepdim=True)) * nm


class EGCL(nn.Module):
    def __init__(self, nf):
        super().__init__()
        self.edge = nn.Sequential(nn.Linear(2 * nf + 1, nf), nn.SiLU(), nn.Linear(nf, nf), nn.SiLU())
        self.node = nn.Sequential(nn.Linear(2 * nf, nf), nn.SiLU(), nn.Linear(nf, nf))
        self.coord = nn.Sequential(nn.Linear(nf, nf), nn.SiLU(), nn.Linear(nf, 1, bias=False))

    def forward(self, h, x, nm, em):
        B, N, C = h.shape
        r = x[:, :, None] - x[:, None]
        d2 = (r ** 2).sum(-1, keepdim=True)
        m = self.edge(torch.cat([h[:, :, None].expand(B, N, N, C), h[:, None].expand(B, N, N, C), d2], -1)) * em
        h = h + self.node(torch.cat([h, m.sum(2) / 100.0], -1)) * nm
        x = x + (r / (d2.sqrt() + 1.0) * self.coord(m) * em).sum(2) / 100.0 * nm
        return h, x


class Dynamics(nn.Module):
    def __init__(self, n_types, nf, layers):
        super().__init__()
        self.n_types = n_types
        self.emb = nn.Linear(n_types + 1, nf)
        self.gcl = nn.ModuleList(EGCL(nf) for _ in range(layers))
        self.out = nn.Linear(nf, n_types)

    def forward(self, x, h, t, nm, em):
        z = self.emb(torch.cat([h, t.view(-1, 1, 1).expand(-1, h.shape[1], 1)], -1)) * nm
        y = x
        for l in self.gcl:
            z, y = l(z, y, nm, em)
        return masked_mean_free(y - x, nm), self.out(z) * nm


def make_masks(atom_mask):
    nm = atom_mask.float().unsqueeze(-1)
    em = nm * nm.transpose(1, 2) * (1 - torch.eye(atom_mask.shape[1], device=atom_mask.device))
    return nm, em.unsqueeze(-1)


def alphas2_poly(T, device):
    t = torch.linspace(0, 1, T + 1, device=device)
    return (1 - 2e-5) * (1 - t ** 2) ** 2 + 1e-5


def edm_loss(model, x, onehot, atom_mask, a2, T):
    nm, em = make_masks(atom_mask)
    x = masked_mean_free(x, nm)
    h = onehot * 0.25 * nm
    t = torch.randint(1, T + 1, (x.shape[0],), device=x.device)
    a = a2[t].view(-1, 1, 1)
    ex, eh = masked_mean_free(torch.randn_like(x), nm), torch.randn_like(h) * nm
    px, ph = model(a.sqrt() * x + (1 - a).sqrt() * ex, a.sqrt() * h + (1 - a).sqrt() * eh, t.float() / T, nm, em)
    err = ((px - ex) ** 2).sum((1, 2)) + ((ph - eh) ** 2).sum((1, 2))
    return (err / (nm.sum((1, 2)) * (3 + h.shape[-1]))).mean()


@torch.no_grad()
def sample_dense(model, n_atoms, a2, T):
    dev = a2.device
    atom_mask = torch.arange(NMAX, device=dev)[None] < n_atoms[:, None]
    nm, em = make_masks(atom_mask)
    x = masked_mean_free(torch.randn(len(n_atoms), NMAX, 3, device=dev), nm)
    h = torch.randn(len(n_atoms), NMAX, model.n_types, device=dev) * nm
    for s in range(T, 0, -1):
        px, ph = model(x, h, torch.full((len(n_atoms),), s / T, device=dev), nm, em)
        r = a2[s] / a2[s - 1]
        c = (1 - r) / (1 - a2[s]).sqrt()
        x, h = (x - c * px) / r.sqrt(), (h - c * ph) / r.sqrt()
        if s > 1:
            sd = ((1 - r) * (1 - a2[s - 1]) / (1 - a2[s])).sqrt()
            x = x + sd * masked_mean_free(torch.randn_like(x), nm)
            h = h + sd * torch.randn_like(h) * nm
    return x, h.argmax(-1), atom_mask


def smiles_of(pos, types):
    lines = [str(len(types)), ""] + [f"{SYMBOLS[t]} {p[0]:.4f} {p[1]:.4f} {p[2]:.4f}"
                                    for p, t in zip(pos.tolist(), types.tolist())]
    try:
        mol = Chem.MolFromXYZBlock("\n".join(lines))
        rdDetermineBonds.DetermineBonds(mol, charge=0)
        Chem.SanitizeMol(mol)
        if len(Chem.GetMolFrags(mol)) > 1:
            return None
        return Chem.MolToSmiles(mol)
    except Exception:
        return None


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(2024 + rank)

    raw = np.load(args.data)
    tr = TensorDataset(torch.from_numpy(raw["train_pos"]).float(), torch.from_numpy(raw["train_onehot"]).float(),
                       torch.from_numpy(raw["train_mask"]).bool())
    va = TensorDataset(torch.from_numpy(raw["val_pos"]).float(), torch.from_numpy(raw["val_onehot"]).float(),
                       torch.from_numpy(raw["val_mask"]).bool())
    train_smiles = set(raw["train_smiles"].tolist())
    n_hist = torch.bincount(tr.tensors[2].sum(1), minlength=NMAX + 1).float()

    tr_s = DistributedSampler(tr, shuffle=True, drop_last=True)
    va_s = DistributedSampler(va, shuffle=False, drop_last=True)
    tr_dl = DataLoader(tr, batch_size=args.bs, sampler=tr_s, num_workers=4, pin_memory=True, drop_last=True)
    va_dl = DataLoader(va, batch_size=args.bs, sampler=va_s, num_workers=2)

    net = Dynamics(len(SYMBOLS), args.nf, args.layers).to(dev)
    model = DDP(net, device_ids=[local_rank])
    ema = Dynamics(len(SYMBOLS), args.nf, args.layers).to(dev).requires_grad_(False)
    ema.load_state_dict(net.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, amsgrad=True, weight_decay=1e-12)
    a2 = alphas2_poly(args.T, dev)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best_score = -1.0
    for epoch in range(args.epochs):
        tr_s.set_epoch(epoch)
        model.train()
        tic = time.time()
        for x, oh, am in tr_dl:
            x, oh, am = x.to(dev), oh.to(dev), am.to(dev)
            loss = edm_loss(model, x, oh, am, a2, args.T)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            with torch.no_grad():
                for pe, p in zip(ema.parameters(), net.parameters()):
                    pe.lerp_(p, 1 - args.ema)

        acc = torch.zeros(2, device=dev)
        with torch.no_grad():
            for x, oh, am in va_dl:
                x, oh, am = x.to(dev), oh.to(dev), am.to(dev)
                acc += torch.stack([edm_loss(ema, x, oh, am, a2, args.T) * len(x),
                                    torch.tensor(float(len(x)), device=dev)])
        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch} val {(acc[0] / acc[1]).item():.4f} ({time.time() - tic:.0f}s)", flush=True)

        if (epoch + 1) % args.sample_every == 0:
            per_rank = math.ceil(args.n_samples / world)
            smiles = []
            for k in range(0, per_rank, 256):
                n_atoms = torch.multinomial(n_hist, min(256, per_rank - k), replacement=True).to(dev)
                x, types, am = sample_dense(ema, n_atoms, a2, args.T)
                for i in range(len(n_atoms)):
                    smiles.append(smiles_of(x[i, am[i]].cpu(), types[i, am[i]].cpu()))
            valid = [s for s in smiles if s is not None]
            validity = len(valid) / len(smiles)
            uniqueness = len(set(valid)) / max(1, len(valid))
            novelty = len(set(valid) - train_smiles) / max(1, len(set(valid)))
            score = validity * uniqueness
            if rank == 0:
                metrics = {"epoch": epoch, "validity": validity, "uniqueness": uniqueness,
                           "novelty": novelty, "n_samples": args.n_samples}
                print(json.dumps(metrics), flush=True)
                with open(os.path.join(args.out, "sample_metrics.jsonl"), "a") as f:
                    f.write(json.dumps(metrics) + "\n")
                if score > best_score:
                    best_score = score
                    torch.save({"ema": ema.state_dict(), "epoch": epoch, **metrics},
                               os.path.join(args.out, "best_ema.pt"))

        if rank == 0:
            torch.save({"model": net.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(),
                        "epoch": epoch}, os.path.join(args.out, "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
