"""Equivariant (e3nn) message-passing potential for bulk water / amorphous carbon MD datasets.

Energy + force matching (forces = -dE/dr via autograd); supports resuming long runs.

    torchrun --nproc_per_node=4 20_e3nn_potential_resume.py --train data/water_train.pt \
        --val data/water_val.pt --out runs/water_e3nn [--resume runs/water_e3nn/last.pt]
"""
import argparse
import logging
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from e3nn import o3
from e3nn.nn import FullyConnectedNet, NormActivation
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("e3nn-pot")


def collate(frames):
    keys = ("species", "pos", "forces")
    out = {k: torch.cat([f[k] for f in frames]) for k in keys}
    offs, eis, shifts, batch = 0, [], [], []
    for i, f in enumerate(frames):
        eis.append(f["edge_index"] + offs)
        shifts.append(f["edge_shift"])  # cartesian periodic image shift per edge (precomputed)
        batch.append(torch.full((f["species"].numel(),), i, dtype=torch.long))
        offs += f["species"].numel()
    out.update(edge_index=torch.cat(eis, 1), edge_shift=torch.cat(shifts), batch=torch.cat(batch),
               energy=torch.stack([f["energy"] for f in frames]), n_graphs=len(frames))
    return out


class Interaction(nn.Module):
    def __init__(self, irreps_in, irreps_out, irreps_sh, n_basis, avg_neigh):
        super().__init__()
        self.tp = o3.FullyConnectedTensorProduct(irreps_in, irreps_sh, irreps_out, shared_weights=False)
        self.radial = FullyConnectedNet([n_basis, 64, 64, self.tp.weight_numel], torch.nn.functional.silu)
        self.self_int = o3.Linear(irreps_in, irreps_out)
        self.lin = o3.Linear(irreps_out, irreps_out)
        self.act = NormActivation(irreps_out, torch.sigmoid)
        self.avg = avg_neigh

    def forward(self, h, sh, basis, ei):
        src, dst = ei
        msg = self.tp(h[src], sh, self.radial(basis))
        agg = torch.zeros(h.shape[0], msg.shape[1], device=h.device, dtype=msg.dtype).index_add_(0, dst, msg)
        return self.act(self.lin(agg / math.sqrt(self.avg)) + self.self_int(h))


class Potential(nn.Module):
    def __init__(self, n_species, cutoff=5.0, n_basis=8, lmax=2, mul=32, n_layers=4, avg_neigh=30.0):
        super().__init__()
        self.cutoff, self.n_basis = cutoff, n_basis
        self.irreps_sh = o3.Irreps.spherical_harmonics(lmax)
        hidden = o3.Irreps(f"{mul}x0e + {mul}x1o + {mul}x2e")
        self.embed = nn.Embedding(n_species, mul)
        irreps = o3.Irreps(f"{mul}x0e")
        layers = []
        for _ in range(n_layers):
            layers.append(Interaction(irreps, hidden, self.irreps_sh, n_basis, avg_neigh))
            irreps = hidden
        self.layers = nn.ModuleList(layers)
        self.readout = o3.Linear(hidden, "1x0e")
        self.register_buffer("e0", torch.zeros(n_species))

    def bessel(self, r):
        n = torch.arange(1, self.n_basis + 1, device=r.device, dtype=r.dtype)
        env = 0.5 * (torch.cos(math.pi * r / self.cutoff) + 1) * (r < self.cutoff)
        return (math.sqrt(2 / self.cutoff) * torch.sin(n * math.pi * r[:, None] / self.cutoff) / r[:, None]) * env[:, None]

    def forward(self, species, pos, ei, shift, batch, n_graphs):
        src, dst = ei
        vec = pos[src] - pos[dst] + shift
        r = vec.norm(dim=-1)
        sh = o3.spherical_harmonics(self.irreps_sh, vec, normalize=True, normalization="component")
        basis = self.bessel(r)
        h = self.embed(species)
        for layer in self.layers:
            h = layer(h, sh, basis, ei)
        e_atom = self.readout(h).squeeze(-1) + self.e0[species]
        return torch.zeros(n_graphs, device=pos.device, dtype=pos.dtype).index_add_(0, batch, e_atom)


def energy_forces(model, b, train):
    pos = b["pos"].requires_grad_(True)
    e = model(b["species"], pos, b["edge_index"], b["edge_shift"], b["batch"], b["n_graphs"])
    f = -torch.autograd.grad(e.sum(), pos, create_graph=train)[0]
    return e, f


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--n-species", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--epochs", type=int, default=1000)
    ap.add_argument("--energy-weight", type=float, default=1.0)
    ap.add_argument("--force-weight", type=float, default=100.0)
    ap.add_argument("--ema-decay", type=float, default=0.99)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    torch.set_default_dtype(torch.float32)

    # preprocessed lists of frames (species, pos, forces, energy, edge_index, edge_shift), CPU tensors
    train_frames = torch.load(args.train, map_location="cpu")
    val_frames = torch.load(args.val, map_location="cpu")
    sampler = DistributedSampler(train_frames, shuffle=True, seed=7)
    train_dl = DataLoader(train_frames, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                          num_workers=2, pin_memory=True)
    val_dl = DataLoader(Subset(val_frames, range(rank, len(val_frames), world)), batch_size=8,
                        collate_fn=collate, num_workers=1)

    net = Potential(args.n_species).to(dev)
    model = DDP(net, device_ids=[local_rank])
    ema = torch.optim.swa_utils.AveragedModel(net, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(args.ema_decay))
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, amsgrad=True)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.8, patience=25)

    start_epoch, best = 0, float("inf")
    if args.resume:
        state = torch.load(args.resume)
        net.load_state_dict(state["model"])
        ema.load_state_dict(state["ema"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        start_epoch, best = state["epoch"] + 1, state["best"]
        log.info("resumed from %s at epoch %d", args.resume, start_epoch)
    elif rank == 0:
        # per-species reference energies from a least-squares fit on the training set
        counts = torch.stack([torch.bincount(f["species"], minlength=args.n_species).double() for f in train_frames])
        energies = torch.stack([f["energy"].double() for f in train_frames])
        e0 = torch.linalg.lstsq(counts, energies[:, None]).solution.squeeze(1)
        net.e0.copy_(e0.float().to(dev))
    if not args.resume:
        dist.broadcast(net.e0, src=0)
        ema.module.e0.copy_(net.e0)

    os.makedirs(args.out, exist_ok=True)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        tl = torch.zeros(2, device=dev)
        for b in train_dl:
            b = {k: (v.to(dev, non_blocking=True) if torch.is_tensor(v) else v) for k, v in b.items()}
            e, f = energy_forces(model, b, train=True)
            n_at = torch.bincount(b["batch"], minlength=b["n_graphs"])
            loss = args.energy_weight * (((e - b["energy"]) / n_at) ** 2).mean() + \
                args.force_weight * ((f - b["forces"]) ** 2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            ema.update_parameters(net)
            tl += torch.stack([loss.detach(), torch.ones((), device=dev)])

        ema.module.eval()
        acc = torch.zeros(4, device=dev, dtype=torch.float64)
        for b in val_dl:
            b = {k: (v.to(dev) if torch.is_tensor(v) else v) for k, v in b.items()}
            e, f = energy_forces(ema.module, b, train=False)
            n_at = torch.bincount(b["batch"], minlength=b["n_graphs"])
            acc[0] += (((e.detach() - b["energy"]) / n_at) ** 2).sum()
            acc[1] += b["n_graphs"]
            acc[2] += ((f.detach() - b["forces"]) ** 2).sum()
            acc[3] += f.numel()
        dist.all_reduce(acc)
        dist.all_reduce(tl)
        e_rmse = math.sqrt(acc[0].item() / acc[1].item()) * 1000
        f_rmse = math.sqrt(acc[2].item() / acc[3].item()) * 1000
        val_loss = args.energy_weight * (e_rmse / 1000) ** 2 + args.force_weight * (f_rmse / 1000) ** 2
        sched.step(val_loss)

        if rank == 0:
            log.info("epoch %4d | train %.5f | val E-RMSE %.2f meV/atom F-RMSE %.1f meV/A | lr %.1e | %.0fs",
                     epoch, (tl[0] / tl[1]).item(), e_rmse, f_rmse, opt.param_groups[0]["lr"], time.time() - t0)
            state = {"model": net.state_dict(), "ema": ema.state_dict(), "optimizer": opt.state_dict(),
                     "scheduler": sched.state_dict(), "epoch": epoch, "best": min(best, val_loss)}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if val_loss < best:
                torch.save({"model": ema.module.state_dict()}, os.path.join(args.out, "best_ema.pt"))
        best = min(best, val_loss)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
