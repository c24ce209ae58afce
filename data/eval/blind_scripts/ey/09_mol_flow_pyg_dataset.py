"""Equivariant flow matching for drug-like molecules (EquiFM / SemlaFlow-lite) on an in-house SDF library.

    torchrun --nproc_per_node=8 09_mol_flow_pyg_dataset.py --root /shared/data/enamine_conf --run_dir /shared/runs/molfm
"""
import argparse
import os
import os.path as osp
import logging

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.data import Data, InMemoryDataset
from torch_geometric.loader import DataLoader
from torch_geometric.utils import scatter
from torch_cluster import radius_graph
from rdkit import Chem

ELEMS = ["C", "N", "O", "F", "P", "S", "Cl", "Br", "I", "H"]
E2I = {e: i for i, e in enumerate(ELEMS)}
log = logging.getLogger("molfm")


class ConformerLibrary(InMemoryDataset):
    """Reads raw/*.sdf once and stores a collated PyG file under processed/."""

    def __init__(self, root, max_atoms=72):
        self.max_atoms = max_atoms
        super().__init__(root)
        self.load(self.processed_paths[0])

    @property
    def raw_file_names(self):
        return sorted(f for f in os.listdir(self.raw_dir) if f.endswith(".sdf"))

    @property
    def processed_file_names(self):
        return [f"conformers_max{self.max_atoms}.pt"]

    def download(self):
        raise RuntimeError(f"put SDF files into {self.raw_dir}")

    def process(self):
        data_list = []
        for fn in self.raw_paths:
            for mol in Chem.SDMolSupplier(fn, removeHs=False):
                if mol is None or mol.GetNumAtoms() > self.max_atoms:
                    continue
                syms = [a.GetSymbol() for a in mol.GetAtoms()]
                if any(s not in E2I for s in syms):
                    continue
                pos = torch.tensor(mol.GetConformer().GetPositions(), dtype=torch.float)
                z = torch.tensor([E2I[s] for s in syms])
                data_list.append(Data(pos=pos - pos.mean(0), z=z, smiles=Chem.MolToSmiles(mol)))
        self.save(data_list, self.processed_paths[0])


class EquivariantLayer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.msg = nn.Sequential(nn.Linear(2 * d + 17, d), nn.SiLU(), nn.Linear(d, d), nn.SiLU())
        self.upd = nn.Sequential(nn.Linear(2 * d, d), nn.SiLU(), nn.Linear(d, d))
        self.vec = nn.Linear(d, 1, bias=False)
        self.ln = nn.LayerNorm(d)
        self.register_buffer("centers", torch.linspace(0, 6, 16))

    def forward(self, h, x, ei):
        i, j = ei
        r = x[i] - x[j]
        d = r.norm(dim=-1, keepdim=True)
        rbf = torch.exp(-4.0 * (d - self.centers) ** 2)
        m = self.msg(torch.cat([h[i], h[j], rbf, d], -1))
        h = self.ln(h + self.upd(torch.cat([h, scatter(m, i, 0, dim_size=h.size(0))], -1)))
        x = x + scatter(r / (d + 1.0) * self.vec(m), i, 0, dim_size=x.size(0), reduce="mean")
        return h, x


class FlowNet(nn.Module):
    def __init__(self, n_elem=len(ELEMS), d=256, n_layers=8, cutoff=6.0):
        super().__init__()
        self.cutoff = cutoff
        self.inp = nn.Linear(n_elem + 1, d)
        self.layers = nn.ModuleList(EquivariantLayer(d) for _ in range(n_layers))
        self.type_head = nn.Linear(d, n_elem)

    def forward(self, x_t, a_t, t, batch):
        ei = radius_graph(x_t, self.cutoff, batch=batch, max_num_neighbors=48)
        h = self.inp(torch.cat([a_t, t[batch].unsqueeze(-1)], -1))
        x = x_t
        for layer in self.layers:
            h, x = layer(h, x, ei)
        v = x - x_t
        v = v - scatter(v, batch, 0, reduce="mean")[batch]
        return v, self.type_head(h)


def com_free(x, batch):
    return x - scatter(x, batch, 0, reduce="mean")[batch]


def flow_loss(net, data, n_elem):
    b = data.batch
    t = torch.rand(data.num_graphs, device=b.device)
    tn = t[b].unsqueeze(-1)
    x1 = com_free(data.pos, b)
    x0 = com_free(torch.randn_like(x1), b)
    a1 = F.one_hot(data.z, n_elem).float()
    a0 = torch.randn_like(a1)
    xt, at = (1 - tn) * x0 + tn * x1, (1 - tn) * a0 + tn * a1
    v, logits = net(xt, at, t, b)
    return F.mse_loss(v, x1 - x0) + 0.2 * F.cross_entropy(logits, data.z)


@torch.no_grad()
def sample(net, n_atoms, steps, device):
    b = torch.repeat_interleave(torch.arange(len(n_atoms), device=device), n_atoms)
    x = com_free(torch.randn(b.numel(), 3, device=device), b)
    a = torch.randn(b.numel(), len(ELEMS), device=device)
    for k in range(steps):
        t = torch.full((len(n_atoms),), k / steps, device=device)
        v, logits = net(x, a, t, b)
        a1_hat = logits.softmax(-1)
        x = x + v / steps
        a = a + (a1_hat - a) / max(1e-3, 1 - k / steps) / steps
    return x, logits.argmax(-1), b


def valid_fraction(x, z, b):
    n_valid = 0
    for g in range(int(b.max()) + 1):
        sel = b == g
        rw = Chem.RWMol()
        for e in z[sel].tolist():
            rw.AddAtom(Chem.Atom(ELEMS[e]))
        conf = Chem.Conformer(int(sel.sum()))
        for k, p in enumerate(x[sel].tolist()):
            conf.SetAtomPosition(k, p)
        rw.AddConformer(conf)
        try:
            from rdkit.Chem import rdDetermineBonds
            rdDetermineBonds.DetermineConnectivity(rw)
            Chem.SanitizeMol(rw)
            n_valid += 1
        except Exception:
            pass
    return n_valid


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--run_dir", required=True)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--batch_size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--ema", type=float, default=0.999)
    ap.add_argument("--n_sample", type=int, default=64, help="molecules per rank per eval")
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN, format="%(asctime)s %(message)s")

    dataset = ConformerLibrary(args.root)
    sizes = torch.bincount(dataset.slices["z"].diff()).float()
    sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                        pin_memory=True, persistent_workers=True)
    log.info("%d molecules, %d steps/epoch/rank", len(dataset), len(loader))

    net = FlowNet().to(dev)
    ema = FlowNet().to(dev)
    ema.load_state_dict(net.state_dict())
    ema.requires_grad_(False)
    model = DDP(net, device_ids=[local_rank])
    torch.manual_seed(1000 + rank)  # per-rank noise and sample draws
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader))

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for data in loader:
            data = data.to(dev, non_blocking=True)
            loss = flow_loss(model, data, len(ELEMS))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            with torch.no_grad():
                torch._foreach_lerp_(list(ema.parameters()), list(net.parameters()), 1 - args.ema)

        if epoch % 5 == 4:
            ema.eval()
            n_atoms = torch.multinomial(sizes, args.n_sample, replacement=True).to(dev)
            x, z, b = sample(ema, n_atoms, args.steps, dev)
            counts = torch.tensor([valid_fraction(x.cpu(), z.cpu(), b.cpu()), args.n_sample],
                                  dtype=torch.float, device=dev)
            dist.all_reduce(counts)
            log.info("epoch %d validity %.3f (%d samples)", epoch, (counts[0] / counts[1]).item(), int(counts[1]))

        if rank == 0:
            os.makedirs(args.run_dir, exist_ok=True)
            torch.save({"net": net.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch}, osp.join(args.run_dir, "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
