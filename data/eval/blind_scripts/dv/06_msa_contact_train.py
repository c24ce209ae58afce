"""Small MSA Transformer (axial row/column attention) trained with masked-MSA loss plus
supervised contacts from the tied row attention maps.

Input: a3m files from HHblits (UniClust30), one per PDB chain, and the matching
contact maps (.npy, L x L, -1 = unknown).

torchrun --nproc_per_node=8 06_msa_contact_train.py --train-list lists/train.txt --valid-list lists/valid.txt
"""
import argparse
import contextlib
import os
import random
import string
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

AAS = "ARNDCQEGHILKMFPSTWYV-X"
TOK = {a: i for i, a in enumerate(AAS)}
GAP, UNKNOWN = TOK["-"], TOK["X"]
MASK_TOK, PAD_TOK = len(AAS), len(AAS) + 1
VOCAB = len(AAS) + 2
_DELETE_LOWER = str.maketrans(dict.fromkeys(string.ascii_lowercase + "."))


def read_a3m(path, max_seqs):
    seqs, cur = [], None
    with open(path) as fh:
        for line in fh:
            line = line.rstrip()
            if line.startswith(">"):
                if cur is not None:
                    seqs.append(cur)
                cur = ""
            else:
                cur += line.translate(_DELETE_LOWER)
    if cur is not None:
        seqs.append(cur)
    query, rest = seqs[0], seqs[1:]
    if len(rest) > max_seqs - 1:
        rest = random.sample(rest, max_seqs - 1)
    return [query] + rest


class MSADataset(Dataset):
    def __init__(self, list_file, max_seqs=128, crop=256, train=True):
        with open(list_file) as fh:
            self.items = [l.split() for l in fh if l.strip()]   # a3m_path contact_path
        self.max_seqs, self.crop, self.train = max_seqs, crop, train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        a3m, cmap = self.items[i]
        msa = read_a3m(a3m, self.max_seqs)
        arr = np.array([[TOK.get(c, UNKNOWN) for c in s] for s in msa], dtype=np.int64)
        contacts = np.load(cmap).astype(np.float32)
        L = arr.shape[1]
        if L > self.crop:
            s = random.randint(0, L - self.crop) if self.train else 0
            arr, contacts = arr[:, s:s + self.crop], contacts[s:s + self.crop, s:s + self.crop]
        return torch.from_numpy(arr), torch.from_numpy(contacts)


def mask_msa(msa, p=0.15):
    sel = (torch.rand(msa.shape, device=msa.device) < p) & (msa != GAP)
    labels = torch.where(sel, msa, torch.full_like(msa, -100))
    inp = msa.masked_fill(sel, MASK_TOK)
    return inp, labels


class AxialBlock(nn.Module):
    def __init__(self, d, heads, ff=4):
        super().__init__()
        self.heads = heads
        self.ln_row = nn.LayerNorm(d)
        self.qkv_row = nn.Linear(d, 3 * d)
        self.o_row = nn.Linear(d, d)
        self.ln_col = nn.LayerNorm(d)
        self.col_attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln_ff = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, ff * d), nn.GELU(), nn.Linear(ff * d, d))

    def tied_row_attention(self, x):
        # x: (N, L, d); attention weights tied (summed) over the N rows of the MSA
        N, L, d = x.shape
        h = self.heads
        q, k, v = self.qkv_row(self.ln_row(x)).view(N, L, 3, h, d // h).unbind(2)
        scale = (d // h) ** -0.5 / np.sqrt(N)
        logits = torch.einsum("nihc,njhc->hij", q * scale, k)
        attn = logits.softmax(-1)
        out = torch.einsum("hij,njhc->nihc", attn, v).reshape(N, L, d)
        return self.o_row(out), attn

    def forward(self, x):
        r, attn = self.tied_row_attention(x)
        x = x + r
        c = self.ln_col(x).transpose(0, 1)               # (L, N, d): attend over sequences
        c, _ = self.col_attn(c, c, c, need_weights=False)
        x = x + c.transpose(0, 1)
        x = x + self.ff(self.ln_ff(x))
        return x, attn


class MiniMSATransformer(nn.Module):
    def __init__(self, d=256, layers=8, heads=8, max_len=1024, max_seqs=512):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.pos = nn.Embedding(max_len, d)
        self.row_pos = nn.Embedding(max_seqs, d)
        self.blocks = nn.ModuleList([AxialBlock(d, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, VOCAB)
        self.contact_reg = nn.Linear(layers * heads, 1)

    def forward(self, msa):
        N, L = msa.shape
        x = self.embed(msa) + self.pos(torch.arange(L, device=msa.device))[None] \
            + self.row_pos(torch.arange(N, device=msa.device))[:, None]
        attns = []
        for blk in self.blocks:
            x, a = blk(x)
            attns.append(a)
        logits = self.lm_head(self.ln(x))
        a = torch.cat(attns, 0)                     # (layers*heads, L, L)
        a = a + a.transpose(-1, -2)
        a = a - a.mean(-1, keepdim=True) * a.mean(-2, keepdim=True) / a.mean((-1, -2), keepdim=True)  # APC
        contact_logits = self.contact_reg(a.permute(1, 2, 0)).squeeze(-1)
        return logits, contact_logits

    @torch.no_grad()
    def predict_contacts(self, msa):
        return torch.sigmoid(self.forward(msa)[1])


def contact_bce(logits, target, min_sep=6):
    L = target.size(0)
    idx = torch.arange(L, device=target.device)
    m = (target >= 0) & ((idx[:, None] - idx[None]).abs() >= min_sep)
    if not m.any():
        return logits.sum() * 0.0
    return F.binary_cross_entropy_with_logits(logits[m], target[m])


def evaluate(model, loader, device, min_sep=24):
    model.eval()
    acc = torch.zeros(2, device=device)
    for msa, target in loader:
        msa, target = msa[0].to(device), target[0].to(device)
        probs = model.predict_contacts(msa)
        L = target.size(0)
        i, j = torch.triu_indices(L, L, offset=min_sep, device=device)
        p, t = probs[i, j], target[i, j]
        ok = t >= 0
        if ok.sum() == 0:
            continue
        k = min(L, int(ok.sum()))
        acc[0] += t[ok][p[ok].topk(k).indices].mean()
        acc[1] += 1
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1].clamp_min(1)).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-list", required=True)
    ap.add_argument("--valid-list", required=True)
    ap.add_argument("--out", default="runs/mini_msa")
    ap.add_argument("--max-seqs", type=int, default=128)
    ap.add_argument("--crop", type=int, default=256)
    ap.add_argument("--accum", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--contact-weight", type=float, default=1.0)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    train_ds = MSADataset(args.train_list, args.max_seqs, args.crop, train=True)
    valid_ds = MSADataset(args.valid_list, args.max_seqs, crop=1024, train=False)
    valid_ds = Subset(valid_ds, range(rank, len(valid_ds), world))
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=1, sampler=sampler, num_workers=6, pin_memory=True)
    valid_loader = DataLoader(valid_ds, batch_size=1, num_workers=2)

    model = MiniMSATransformer().to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=args.lr, total_steps=args.epochs * (len(train_loader) // args.accum) + 1, pct_start=0.05)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for it, (msa, target) in enumerate(train_loader):
            msa, target = msa[0].to(device, non_blocking=True), target[0].to(device, non_blocking=True)
            inp, labels = mask_msa(msa)
            sync = (it + 1) % args.accum == 0
            with (contextlib.nullcontext() if sync else model.no_sync()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits, c_logits = model(inp)
                mlm = F.cross_entropy(logits.float().view(-1, VOCAB), labels.view(-1), ignore_index=-100)
                loss = mlm + args.contact_weight * contact_bce(c_logits.float(), target)
                (loss / args.accum).backward()
            if sync:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
            if rank == 0 and it % 200 == 0:
                print(f"ep {epoch} it {it} mlm {mlm.item():.3f} loss {loss.item():.3f}", flush=True)

        p_l = evaluate(model, valid_loader, device)
        if rank == 0:
            print(f"epoch {epoch} long-range P@L {p_l:.4f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "p_at_l": p_l},
                       os.path.join(args.out, "last.pt"))
            if p_l > best:
                best = p_l
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
