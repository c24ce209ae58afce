"""Single-sequence structure model: residue transformer trunk -> pair features -> distogram
(64 bins, 2-22 A) and, where backbone torsions are available, a phi/psi head.

Long crops do not fit without activation checkpointing, so every trunk and pair block is
recomputed in the backward pass.

    torchrun --nproc_per_node=8 20_distogram_trunk.py --chains /data/pdb_chains --train_list splits/train.txt \
        --valid_list splits/cameo_valid.txt --crop 384
"""
import argparse
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, DistributedSampler

AA = "ACDEFGHIKLMNPQRSTVWYX"
N_BINS = 64
BIN_EDGES = torch.linspace(2.0, 22.0, N_BINS - 1)


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--chains", required=True)
    ap.add_argument("--train_list", required=True)
    ap.add_argument("--valid_list", required=True)
    ap.add_argument("--crop", type=int, default=384)
    ap.add_argument("--d_seq", type=int, default=512)
    ap.add_argument("--d_pair", type=int, default=128)
    ap.add_argument("--seq_layers", type=int, default=16)
    ap.add_argument("--pair_blocks", type=int, default=12)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--out", default="runs/distogram")
    return ap.parse_args()


class Chains(Dataset):
    def __init__(self, root, list_file, crop, train):
        self.root, self.crop, self.train = root, crop, train
        self.ids = [l.split()[0] for l in open(list_file) if l.strip()]

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        d = np.load(os.path.join(self.root, self.ids[i] + ".npz"))
        seq, cb = str(d["seq"]), d["cb"].astype(np.float32)  # L x 3, NaN for missing residues
        tors = d["torsions"].astype(np.float32) if "torsions" in d else np.full((len(seq), 2), np.nan, np.float32)
        L = len(seq)
        s = np.random.randint(0, L - self.crop + 1) if (self.train and L > self.crop) else 0
        e = min(L, s + self.crop)
        aa = torch.tensor([AA.index(c) if c in AA else 20 for c in seq[s:e]])
        return aa, torch.from_numpy(cb[s:e]), torch.from_numpy(tors[s:e])


def collate(batch):
    L = max(b[0].shape[0] for b in batch)
    B = len(batch)
    aa = torch.full((B, L), 20, dtype=torch.long)
    cb = torch.full((B, L, 3), float("nan"))
    tors = torch.full((B, L, 2), float("nan"))
    mask = torch.zeros(B, L, dtype=torch.bool)
    for k, (a, c, t) in enumerate(batch):
        n = a.shape[0]
        aa[k, :n], cb[k, :n], tors[k, :n], mask[k, :n] = a, c, t, True
    return aa, cb, tors, mask


class SeqBlock(nn.Module):
    def __init__(self, d, heads=8):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, pad):
        h = self.n1(x)
        x = x + self.attn(h, h, h, key_padding_mask=pad, need_weights=False)[0]
        return x + self.ff(self.n2(x))


class PairBlock(nn.Module):
    def __init__(self, c, dilation):
        super().__init__()
        self.net = nn.Sequential(nn.InstanceNorm2d(c, affine=True), nn.ELU(),
                                 nn.Conv2d(c, c, 3, padding=dilation, dilation=dilation),
                                 nn.InstanceNorm2d(c, affine=True), nn.ELU(), nn.Conv2d(c, c, 3, padding=1))

    def forward(self, z):
        return z + self.net(z)


class DistogramNet(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.embed = nn.Embedding(len(AA), a.d_seq)
        self.pos = nn.Embedding(65, a.d_pair)  # clipped relative position
        self.seq_blocks = nn.ModuleList([SeqBlock(a.d_seq) for _ in range(a.seq_layers)])
        self.left, self.right = nn.Linear(a.d_seq, a.d_pair), nn.Linear(a.d_seq, a.d_pair)
        self.pair_blocks = nn.ModuleList([PairBlock(a.d_pair, 2 ** (i % 4)) for i in range(a.pair_blocks)])
        self.dist_head = nn.Conv2d(a.d_pair, N_BINS, 1)
        self.tors_head = nn.Linear(a.d_seq, 4)  # sin/cos of phi, psi

    def forward(self, aa, mask, want_torsions):
        x = self.embed(aa)
        for blk in self.seq_blocks:
            x = checkpoint(blk, x, ~mask, use_reentrant=True)
        L = aa.shape[1]
        rel = torch.arange(L, device=aa.device)
        rel = (rel[None, :] - rel[:, None]).clamp(-32, 32) + 32
        z = self.left(x)[:, :, None] + self.right(x)[:, None, :] + self.pos(rel)[None]
        z = z.permute(0, 3, 1, 2)
        for blk in self.pair_blocks:
            z = checkpoint(blk, z, use_reentrant=True)
        logits = self.dist_head(z)
        logits = 0.5 * (logits + logits.transpose(-1, -2))
        tors = self.tors_head(x) if want_torsions else None
        return logits, tors


def distogram_targets(cb, mask):
    d = torch.cdist(cb.nan_to_num(0.0), cb.nan_to_num(0.0))
    valid = mask[:, :, None] & mask[:, None, :] & ~torch.isnan(cb[..., 0])[:, :, None] & ~torch.isnan(cb[..., 0])[:, None, :]
    return torch.bucketize(d, BIN_EDGES.to(d.device)), valid


@torch.no_grad()
def contact_precision(model, loader, device):
    """Top-L/5 long-range (|i-j|>=24) precision with P(d<8A) from the distogram."""
    model.eval()
    acc = torch.zeros(2, device=device)
    contact_bins = int((BIN_EDGES < 8.0).sum()) + 1
    for aa, cb, _, mask in loader:
        aa, cb, mask = aa.to(device), cb.to(device), mask.to(device)
        logits, _ = model(aa, mask, want_torsions=False)
        p_contact = logits.softmax(1)[:, :contact_bins].sum(1)
        tgt, valid = distogram_targets(cb, mask)
        for k in range(aa.shape[0]):
            L = int(mask[k].sum())
            i, j = torch.triu_indices(L, L, 24, device=device)
            ok = valid[k, i, j]
            if ok.sum() == 0:
                continue
            sc, tr = p_contact[k, i, j][ok], (tgt[k, i, j][ok] < contact_bins).float()
            top = sc.topk(min(max(1, L // 5), sc.numel())).indices
            acc += torch.stack([tr[top].mean(), torch.ones((), device=device)])
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_ds = Chains(args.chains, args.train_list, args.crop, train=True)
    valid_ds = Chains(args.chains, args.valid_list, 1024, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True)
    loader = DataLoader(train_ds, batch_size=1, sampler=sampler, collate_fn=collate, num_workers=4, pin_memory=True)
    valid_loader = DataLoader(valid_ds, batch_size=1, sampler=DistributedSampler(valid_ds, shuffle=False),
                              collate_fn=collate, num_workers=2)

    model = DistogramNet(args).to(device)
    # torsion labels exist only for part of the chains, so the torsion head is idle on some steps
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 1000))

    best = 0.0
    os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for it, (aa, cb, tors, mask) in enumerate(loader):
            aa, cb, tors, mask = aa.to(device), cb.to(device), tors.to(device), mask.to(device)
            has_tors = bool((~torch.isnan(tors[..., 0])).any())
            logits, tors_pred = model(aa, mask, want_torsions=has_tors)
            tgt, valid = distogram_targets(cb, mask)
            loss = F.cross_entropy(logits.permute(0, 2, 3, 1)[valid], tgt[valid])
            if has_tors:
                tm = ~torch.isnan(tors[..., 0]) & mask
                ang = torch.stack([torch.sin(tors), torch.cos(tors)], -1).flatten(-2)
                loss = loss + 0.5 * F.mse_loss(tors_pred[tm], ang[tm])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if rank == 0 and it % 100 == 0:
                print(f"epoch {epoch} it {it} loss {loss.item():.4f}", flush=True)

        prec = contact_precision(model, valid_loader, device)
        if rank == 0:
            print(f"epoch {epoch} long-range top-L/5 precision {prec:.4f}", flush=True)
            if prec > best:
                best = prec
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "args": vars(args)},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
