"""Indoor matcher (DISK features + attentional GNN) trained on ScanNet, validated by epipolar precision.

    torchrun --nproc_per_node=8 09_scannet_gnn_matcher_epipolar.py --root /data/scannet_disk --out runs/scannet_gnn
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from kornia.geometry.epipolar import essential_from_Rt, symmetrical_epipolar_distance
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", default="runs/scannet_gnn")
    p.add_argument("--max_kpts", type=int, default=1024)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--epi_thr", type=float, default=5e-4, help="normalised symmetric epipolar threshold")
    return p.parse_args()


class ScanNetDiskPairs(Dataset):
    """npz per pair: kpts0/1 (N,2), desc0/1 (N,128), K0/K1, T_0to1, gt0 (N,) index into kpts1 or -1."""

    def __init__(self, root, split, max_kpts):
        self.dir = os.path.join(root, split)
        self.files = sorted(f for f in os.listdir(self.dir) if f.endswith(".npz"))
        self.max_kpts = max_kpts

    def __len__(self):
        return len(self.files)

    def _pad(self, arr, fill=0.0):
        out = np.full((self.max_kpts,) + arr.shape[1:], fill, dtype=arr.dtype)
        out[: min(len(arr), self.max_kpts)] = arr[: self.max_kpts]
        return out

    def __getitem__(self, i):
        z = np.load(os.path.join(self.dir, self.files[i]))
        n0, n1 = min(len(z["kpts0"]), self.max_kpts), min(len(z["kpts1"]), self.max_kpts)
        gt0 = z["gt0"][: self.max_kpts].astype(np.int64)
        gt0[gt0 >= n1] = -1
        return {
            "kpts0": self._pad(z["kpts0"].astype(np.float32)), "kpts1": self._pad(z["kpts1"].astype(np.float32)),
            "desc0": self._pad(z["desc0"].astype(np.float32)), "desc1": self._pad(z["desc1"].astype(np.float32)),
            "n0": n0, "n1": n1, "gt0": self._pad(gt0, -1),
            "K0": z["K0"].astype(np.float32), "K1": z["K1"].astype(np.float32),
            "T_0to1": z["T_0to1"].astype(np.float32),
        }


class CrossBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ffn = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x0, x1, pad0, pad1):
        q0, q1 = self.norm(x0), self.norm(x1)
        m0 = self.attn(q0, q1, q1, key_padding_mask=pad1, need_weights=False)[0]
        m1 = self.attn(q1, q0, q0, key_padding_mask=pad0, need_weights=False)[0]
        x0, x1 = x0 + m0, x1 + m1
        return x0 + self.ffn(x0), x1 + self.ffn(x1)


class GNNMatcher(nn.Module):
    def __init__(self, dim=128, layers=6, heads=4):
        super().__init__()
        self.pos = nn.Sequential(nn.Linear(2, 64), nn.ReLU(), nn.Linear(64, dim))
        self.self_layers = nn.ModuleList(
            [nn.TransformerEncoderLayer(dim, heads, 2 * dim, 0.0, batch_first=True, norm_first=True)
             for _ in range(layers)])
        self.cross_layers = nn.ModuleList([CrossBlock(dim, heads) for _ in range(layers)])
        self.proj = nn.Linear(dim, dim)
        self.dustbin = nn.Parameter(torch.tensor(1.0))

    @staticmethod
    def _norm(k, K):
        return (k - K[:, None, :2, 2]) / K[:, None, [0, 1], [0, 1]]

    def forward(self, d):
        b, m, _ = d["kpts0"].shape
        ar = torch.arange(m, device=d["kpts0"].device)[None]
        pad0, pad1 = ar >= d["n0"][:, None], ar >= d["n1"][:, None]
        x0 = d["desc0"] + self.pos(self._norm(d["kpts0"], d["K0"]))
        x1 = d["desc1"] + self.pos(self._norm(d["kpts1"], d["K1"]))
        for sl, cl in zip(self.self_layers, self.cross_layers):
            x0 = sl(x0, src_key_padding_mask=pad0)
            x1 = sl(x1, src_key_padding_mask=pad1)
            x0, x1 = cl(x0, x1, pad0, pad1)
        f0, f1 = self.proj(x0), self.proj(x1)
        s = torch.einsum("bmd,bnd->bmn", f0, f1) / f0.size(-1) ** 0.5
        s = s.masked_fill(pad0[:, :, None] | pad1[:, None, :], -1e4)
        s = torch.cat([s, self.dustbin.expand(b, m, 1)], 2)
        return s.log_softmax(2)  # each keypoint in image 0 -> a keypoint in image 1 or the dustbin


def loss_fn(logp, gt0, n0):
    m = gt0.size(1)
    valid = torch.arange(m, device=gt0.device)[None] < n0[:, None]
    tgt = torch.where(gt0 >= 0, gt0, torch.full_like(gt0, logp.size(2) - 1))
    nll = -logp.gather(2, tgt[..., None])[..., 0]
    return (nll * valid).sum() / valid.sum()


@torch.no_grad()
def epipolar_errors(net, loader, device):
    net.eval()
    errs = []
    for d in loader:
        d = {k: v.to(device) for k, v in d.items()}
        logp = net(d)
        best = logp.argmax(2)
        for b in range(best.size(0)):
            n0 = int(d["n0"][b])
            j = best[b, :n0]
            keep = j < int(d["n1"][b])
            if keep.sum() == 0:
                continue
            K0, K1, T = d["K0"][b], d["K1"][b], d["T_0to1"][b]
            p0 = GNNMatcher._norm(d["kpts0"][b, :n0][keep][None], K0[None])
            p1 = GNNMatcher._norm(d["kpts1"][b][j[keep]][None], K1[None])
            E = essential_from_Rt(torch.eye(3, device=device)[None], torch.zeros(1, 3, 1, device=device),
                                  T[None, :3, :3], T[None, :3, 3:])
            errs.append(symmetrical_epipolar_distance(p0, p1, E)[0])
    net.train()
    return torch.cat(errs) if errs else torch.zeros(0, device=device)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(7)

    train_ds = ScanNetDiskPairs(args.root, "train", args.max_kpts)
    val_ds = ScanNetDiskPairs(args.root, "val", args.max_kpts)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, 8, sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True), num_workers=4)

    model = DDP(GNNMatcher(args.dim, args.layers).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_dl), eta_min=1e-6)

    writer = SummaryWriter(args.out) if rank == 0 else None
    best_prec = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for d in train_dl:
            d = {k: v.to(device, non_blocking=True) for k, v in d.items()}
            loss = loss_fn(model(d), d["gt0"], d["n0"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(tot)

        local = epipolar_errors(model.module, val_dl, device)
        gathered = [torch.zeros_like(local) for _ in range(world)]
        dist.all_gather(gathered, local)
        all_errs = torch.cat(gathered)
        prec = (all_errs < args.epi_thr).float().mean().item() if all_errs.numel() else 0.0

        if rank == 0:
            print(f"epoch {epoch} loss {(tot[0] / tot[1]).item():.4f} P@{args.epi_thr:g} {prec:.4f} "
                  f"n_matches {all_errs.numel()} ({time.time() - t0:.0f}s)")
            writer.add_scalar("train/loss", (tot[0] / tot[1]).item(), epoch)
            writer.add_scalar("val/precision", prec, epoch)
            writer.add_scalar("val/num_matches", all_errs.numel() / len(val_ds), epoch)
            os.makedirs(args.out, exist_ok=True)
            state = {"model": model.module.state_dict(), "epoch": epoch, "args": vars(args)}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if prec > best_prec:
                best_prec = prec
                torch.save(state, os.path.join(args.out, "best.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
