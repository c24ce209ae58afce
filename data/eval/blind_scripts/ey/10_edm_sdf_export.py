"""EDM training on GEOM-QM9 conformers with periodic SDF export of generated molecules.

Each eval round every rank samples its share of molecules; rank 0 collects them,
writes one SDF for the medicinal chemists and logs validity / novelty to MLflow.

    torchrun --nproc_per_node=8 10_edm_sdf_export.py --train data/geom_qm9_train.pt --out /shared/edm_sdf
"""
import argparse
import os
import time

import mlflow
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from rdkit import Chem
from rdkit.Chem import rdDetermineBonds
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.loader import DataLoader
from torch_geometric.utils import scatter

ATOMS = ["H", "C", "N", "O", "F"]


def opts():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=800)
    p.add_argument("--bs", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--T", type=int, default=1000)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=9)
    p.add_argument("--ema", type=float, default=0.999)
    p.add_argument("--eval_every", type=int, default=50)
    p.add_argument("--samples_per_gpu", type=int, default=256)
    return p.parse_args()


class EGCL(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fe = nn.Sequential(nn.Linear(2 * d + 1, d), nn.SiLU(), nn.Linear(d, d), nn.SiLU())
        self.fh = nn.Sequential(nn.Linear(2 * d, d), nn.SiLU(), nn.Linear(d, d))
        self.fx = nn.Sequential(nn.Linear(d, d), nn.SiLU(), nn.Linear(d, 1, bias=False))

    def forward(self, h, x, ei):
        a, b = ei
        r = x[a] - x[b]
        d2 = (r * r).sum(-1, keepdim=True)
        m = self.fe(torch.cat([h[a], h[b], d2], -1))
        h = h + self.fh(torch.cat([h, scatter(m, a, 0, dim_size=h.size(0)) / 100.0], -1))
        x = x + scatter(r / (d2.sqrt() + 1) * self.fx(m), a, 0, dim_size=x.size(0)) / 100.0
        return h, x


class EDM(nn.Module):
    def __init__(self, d, L, n_types=len(ATOMS)):
        super().__init__()
        self.n_types = n_types
        self.h_in = nn.Linear(n_types + 1, d)
        self.gcl = nn.ModuleList(EGCL(d) for _ in range(L))
        self.h_out = nn.Linear(d, n_types)

    @staticmethod
    def edges(batch):
        adj = batch[:, None] == batch[None, :]
        adj.fill_diagonal_(False)
        return adj.nonzero().T

    def forward(self, x, h, t, batch):
        ei = self.edges(batch)
        z = self.h_in(torch.cat([h, t[batch, None]], -1))
        y = x
        for layer in self.gcl:
            z, y = layer(z, y, ei)
        ex = y - x
        ex = ex - scatter(ex, batch, 0, reduce="mean")[batch]
        return ex, self.h_out(z)


def zero_mean(x, batch):
    return x - scatter(x, batch, 0, reduce="mean")[batch]


def schedule(T, device):
    t = torch.linspace(0, 1, T + 1, device=device)
    return (1 - 2e-5) * (1 - t ** 2) ** 2 + 1e-5


def edm_loss(model, data, a2, T, n_types):
    bt = data.batch
    t = torch.randint(1, T + 1, (data.num_graphs,), device=bt.device)
    a = a2[t][bt, None]
    x0 = zero_mean(data.pos, bt)
    h0 = F.one_hot(data.atom_type, n_types).float() * 0.25
    ex, eh = zero_mean(torch.randn_like(x0), bt), torch.randn_like(h0)
    px, ph = model(a.sqrt() * x0 + (1 - a).sqrt() * ex, a.sqrt() * h0 + (1 - a).sqrt() * eh, t.float() / T, bt)
    return F.mse_loss(px, ex) + F.mse_loss(ph, eh)


@torch.no_grad()
def ancestral_sample(model, n_atoms, a2, T):
    dev = a2.device
    bt = torch.repeat_interleave(torch.arange(n_atoms.numel(), device=dev), n_atoms)
    x = zero_mean(torch.randn(bt.numel(), 3, device=dev), bt)
    h = torch.randn(bt.numel(), model.n_types, device=dev)
    for s in range(T, 0, -1):
        ex, eh = model(x, h, torch.full((n_atoms.numel(),), s / T, device=dev), bt)
        r = a2[s] / a2[s - 1]
        c = (1 - r) / (1 - a2[s]).sqrt()
        x, h = (x - c * ex) / r.sqrt(), (h - c * eh) / r.sqrt()
        if s > 1:
            sd = ((1 - r) * (1 - a2[s - 1]) / (1 - a2[s])).sqrt()
            x, h = x + sd * zero_mean(torch.randn_like(x), bt), h + sd * torch.randn_like(h)
    return x, h.argmax(-1)


def to_mol(pos, types):
    block = f"{len(types)}\n\n" + "\n".join(
        f"{ATOMS[t]} {p[0]:.4f} {p[1]:.4f} {p[2]:.4f}" for p, t in zip(pos.tolist(), types.tolist()))
    mol = Chem.MolFromXYZBlock(block)
    try:
        rdDetermineBonds.DetermineBonds(mol, charge=0)
        Chem.SanitizeMol(mol)
        return mol
    except Exception:
        return None


def main():
    args = opts()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(7 + rank)

    train = torch.load(args.train)  # list[Data(pos, atom_type, smiles)]
    train_smiles = {d.smiles for d in train}
    size_dist = torch.bincount(torch.tensor([d.num_nodes for d in train])).float()
    sampler = DistributedSampler(train, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(train, batch_size=args.bs, sampler=sampler, num_workers=4, pin_memory=True)

    net = EDM(args.hidden, args.layers).to(device)
    model = DDP(net, device_ids=[local_rank])
    ema = EDM(args.hidden, args.layers).to(device).requires_grad_(False)
    ema.load_state_dict(net.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, amsgrad=True, weight_decay=1e-12)
    a2 = schedule(args.T, device)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        mlflow.set_experiment("edm-geom-qm9")
        mlflow.start_run()
        mlflow.log_params(vars(args) | {"world_size": world})

    gstep = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for data in loader:
            data = data.to(device)
            loss = edm_loss(model, data, a2, args.T, len(ATOMS))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            with torch.no_grad():
                for q, p in zip(ema.parameters(), net.parameters()):
                    q.mul_(args.ema).add_(p, alpha=1 - args.ema)
            gstep += 1
            if rank == 0 and gstep % 200 == 0:
                mlflow.log_metric("train_loss", loss.item(), step=gstep)

        if (epoch + 1) % args.eval_every == 0:
            n_atoms = torch.multinomial(size_dist, args.samples_per_gpu, replacement=True).to(device)
            pos, types = ancestral_sample(ema, n_atoms, a2, args.T)

            all_n = [torch.zeros_like(n_atoms) for _ in range(world)]
            all_pos = [torch.zeros_like(pos) for _ in range(world)]
            all_types = [torch.zeros_like(types) for _ in range(world)]
            dist.all_gather(all_n, n_atoms)
            dist.all_gather(all_pos, pos)
            dist.all_gather(all_types, types)

            if rank == 0:
                writer = Chem.SDWriter(os.path.join(args.out, f"samples_ep{epoch:04d}.sdf"))
                n_valid, smiles = 0, []
                for n_r, p_r, t_r in zip(all_n, all_pos, all_types):
                    for p, t in zip(p_r.cpu().split(n_r.tolist()), t_r.cpu().split(n_r.tolist())):
                        mol = to_mol(p, t)
                        if mol is None:
                            continue
                        n_valid += 1
                        smiles.append(Chem.MolToSmiles(mol))
                        writer.write(mol)
                writer.close()
                n_tot = world * args.samples_per_gpu
                uniq = set(smiles)
                mlflow.log_metrics({"validity": n_valid / n_tot,
                                    "uniqueness": len(uniq) / max(1, n_valid),
                                    "novelty": len(uniq - train_smiles) / max(1, len(uniq)),
                                    "epoch_time": time.time() - tic}, step=gstep)

        if rank == 0:
            torch.save({"net": net.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(),
                        "epoch": epoch}, os.path.join(args.out, "checkpoint.pt"))
        dist.barrier()

    if rank == 0:
        mlflow.end_run()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
