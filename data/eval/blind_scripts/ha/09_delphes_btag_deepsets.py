#!/usr/bin/env python
"""b-jet tagging with a DeepSets over jet tracks + jet-level features.

Reads the flat Delphes ntuples produced by our ntupliser (TTree "jets", one entry
per jet) with uproot, pads the track collections to a fixed length and caches the
result as .npz next to the run directory so later runs start immediately.

Run with:
    torchrun --nproc_per_node=4 09_delphes_btag_deepsets.py \
        --ntuples "/eos/user/a/abtag/ntuples/ttbar_*.root" --cache-dir /eos/user/a/abtag/cache
"""
import argparse
import glob
import hashlib
import os

import awkward as ak
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import uproot
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

JET_VARS = ["jet_pt", "jet_eta", "jet_mass", "jet_ntracks", "jet_nsv", "jet_sv_mass", "jet_sv_l3dsig"]
TRK_VARS = ["trk_ptrel", "trk_deta", "trk_dphi", "trk_d0sig", "trk_z0sig", "trk_charge"]
MAX_TRACKS = 25
FLAVOURS = {0: 0, 4: 1, 5: 2}  # light, c, b  (hadron truth flavour)


def read_ntuples(files):
    jets, trks, labels = [], [], []
    for arrays in uproot.iterate([f"{f}:jets" for f in files], JET_VARS + TRK_VARS + ["jet_flavour"],
                                 step_size="200 MB", library="ak"):
        jets.append(np.stack([ak.to_numpy(arrays[v]) for v in JET_VARS], axis=1))
        padded = [ak.to_numpy(ak.fill_none(ak.pad_none(arrays[v], MAX_TRACKS, clip=True), 0.0))
                  for v in TRK_VARS]
        trks.append(np.stack(padded, axis=-1))
        labels.append(np.vectorize(FLAVOURS.get)(ak.to_numpy(arrays["jet_flavour"])))
    jets = np.concatenate(jets).astype(np.float32)
    jets[:, 0] = np.log(jets[:, 0])
    return jets, np.concatenate(trks).astype(np.float32), np.concatenate(labels).astype(np.int64)


def load_dataset(pattern, cache_dir):
    files = sorted(glob.glob(pattern))
    key = hashlib.md5("".join(files).encode()).hexdigest()[:10]
    cache = os.path.join(cache_dir, f"btag_{key}.npz")
    if not os.path.exists(cache):
        os.makedirs(cache_dir, exist_ok=True)
        jets, trks, labels = read_ntuples(files)
        np.savez(cache, jets=jets, trks=trks, labels=labels)
    with np.load(cache) as d:
        return d["jets"], d["trks"], d["labels"]


class DeepSetsTagger(nn.Module):
    def __init__(self, n_trk=len(TRK_VARS), n_jet=len(JET_VARS), latent=64, n_classes=3):
        super().__init__()
        self.phi = nn.Sequential(nn.Linear(n_trk, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                                 nn.Linear(64, latent))
        self.rho = nn.Sequential(nn.Linear(latent + n_jet, 128), nn.ReLU(), nn.Dropout(0.1),
                                 nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, n_classes))
        self.register_buffer("jet_mean", torch.zeros(n_jet))
        self.register_buffer("jet_std", torch.ones(n_jet))

    def forward(self, jet, trk):
        mask = (trk.abs().sum(-1, keepdim=True) > 0).float()
        pooled = (self.phi(trk) * mask).sum(1)
        jet = (jet - self.jet_mean) / self.jet_std
        return self.rho(torch.cat([pooled, jet], dim=1))


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ntuples", required=True)
    ap.add_argument("--cache-dir", required=True)
    ap.add_argument("--out", default="runs/btag_deepsets")
    ap.add_argument("--epochs", type=int, default=25)
    ap.add_argument("--bs", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--val-frac", type=float, default=0.1)
    return ap.parse_args()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    jets, trks, labels = load_dataset(args.ntuples, args.cache_dir)
    n_val = int(len(labels) * args.val_frac)
    # deterministic split (same permutation on every rank)
    perm = np.random.default_rng(2024).permutation(len(labels))
    tr, va = perm[n_val:], perm[:n_val]
    va = va[rank::world]
    train_ds = TensorDataset(torch.from_numpy(jets[tr]), torch.from_numpy(trks[tr]), torch.from_numpy(labels[tr]))
    val_ds = TensorDataset(torch.from_numpy(jets[va]), torch.from_numpy(trks[va]), torch.from_numpy(labels[va]))

    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=2, pin_memory=True)
    val_dl = DataLoader(val_ds, batch_size=4096, num_workers=2, pin_memory=True)

    model = DeepSetsTagger()
    model.jet_mean.copy_(torch.from_numpy(jets[tr].mean(0)))
    model.jet_std.copy_(torch.from_numpy(jets[tr].std(0) + 1e-6))
    model = DDP(model.to(device), device_ids=[local_rank])

    # class weights against the light-jet dominance
    counts = np.bincount(labels[tr], minlength=3)
    class_w = torch.tensor(counts.sum() / (3 * counts), dtype=torch.float32, device=device)

    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_dl))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"jets: train {len(tr)} val {n_val}; flavour counts (l,c,b) = {counts.tolist()}", flush=True)

    best = float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for jet, trk, y in train_dl:
            jet, trk, y = jet.to(device, non_blocking=True), trk.to(device, non_blocking=True), y.to(device)
            loss = F.cross_entropy(model(jet, trk), y, weight=class_w)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()

        model.eval()
        s = torch.zeros(4, device=device)  # loss_sum, weight_sum, light jets with D_b > 0, light jets
        with torch.no_grad():
            for jet, trk, y in val_dl:
                jet, trk, y = jet.to(device), trk.to(device), y.to(device)
                logits = model.module(jet, trk)
                s[0] += F.cross_entropy(logits, y, weight=class_w, reduction="sum")
                s[1] += class_w[y].sum()
                p = logits.softmax(1)
                disc = torch.log(p[:, 2] / (0.05 * p[:, 1] + 0.95 * p[:, 0] + 1e-8))
                s[2] += ((disc > 0.0) & (y == 0)).sum()
                s[3] += (y == 0).sum()
        dist.all_reduce(s)
        val_loss = (s[0] / s[1]).item()
        if rank == 0:
            print(f"epoch {epoch}: val loss {val_loss:.4f}, light mistag (D_b>0) {(s[2] / s[3]).item():.4f}",
                  flush=True)
            if val_loss < best:
                best = val_loss
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "jet_vars": JET_VARS,
                            "trk_vars": TRK_VARS}, os.path.join(args.out, "best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
