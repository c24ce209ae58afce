"""ESM-style MLM with an auxiliary contact loss on the attention maps.

Training mixes UniRef50 sequences (no structure) with PDB chains that come with
a contact map; the contact term (logistic regression on APC-corrected, symmetrised
attention maps, as in ESM's ContactPredictionHead) is added for the structure entries.

    torchrun --nproc_per_node=8 10_esm_contact_head_mlm.py --uniref uniref50_2M.fasta --pdb pdb_contacts/ \
        --valid-pdb pdb_contacts_valid/
"""
import argparse
import glob
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

TOKENS = ["<cls>", "<pad>", "<eos>", "<unk>"] + list("LAGVSERTIDPKQNFYMHWCXBUZO") + ["<mask>"]
IDX = {t: i for i, t in enumerate(TOKENS)}
CLS, PAD, EOS, UNK, MASK = IDX["<cls>"], IDX["<pad>"], IDX["<eos>"], IDX["<unk>"], IDX["<mask>"]


def encode(seq):
    return [CLS] + [IDX.get(a, UNK) for a in seq] + [EOS]


class UnirefSeqs(Dataset):
    def __init__(self, fasta, max_len):
        self.seqs = []
        cur = []
        for line in open(fasta):
            if line.startswith(">"):
                if cur:
                    self.seqs.append("".join(cur))
                cur = []
            else:
                cur.append(line.strip())
        if cur:
            self.seqs.append("".join(cur))
        self.max_len = max_len

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        s = self.seqs[i]
        if len(s) > self.max_len:
            o = random.randint(0, len(s) - self.max_len)
            s = s[o:o + self.max_len]
        return torch.tensor(encode(s)), None


class PDBContacts(Dataset):
    def __init__(self, root, max_len):
        self.files = sorted(glob.glob(os.path.join(root, "*.npz")))
        self.max_len = max_len

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        d = np.load(self.files[i])
        s, c = str(d["seq"]), d["contacts"].astype(np.float32)
        if len(s) > self.max_len:
            o = random.randint(0, len(s) - self.max_len)
            s, c = s[o:o + self.max_len], c[o:o + self.max_len, o:o + self.max_len]
        return torch.tensor(encode(s)), torch.from_numpy(c)


def collate(items):
    toks, maps = zip(*items)
    L = max(len(t) for t in toks)
    tokens = torch.full((len(toks), L), PAD, dtype=torch.long)
    for i, t in enumerate(toks):
        tokens[i, : len(t)] = t
    contacts = None
    if any(m is not None for m in maps):
        contacts = torch.full((len(toks), L - 2, L - 2), -1.0)
        for i, m in enumerate(maps):
            if m is not None:
                contacts[i, : m.shape[0], : m.shape[1]] = m
    return tokens, contacts


def apc(x):
    a1, a2 = x.sum(-1, keepdims=True), x.sum(-2, keepdims=True)
    return x - a1 * a2 / x.sum((-1, -2), keepdims=True)


class ContactPredictionHead(nn.Module):
    def __init__(self, in_features):
        super().__init__()
        self.regression = nn.Linear(in_features, 1)

    def forward(self, attn):
        # attn: (B, layers, heads, T, T) with BOS/EOS still present
        attn = attn[..., 1:-1, 1:-1]
        B, Ly, H, T, _ = attn.shape
        attn = attn.reshape(B, Ly * H, T, T)
        attn = apc(attn + attn.transpose(-1, -2))
        return self.regression(attn.permute(0, 2, 3, 1)).squeeze(-1)


class Layer(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, pad_mask, need_weights):
        B, T, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        bias = torch.zeros(B, 1, 1, T, device=x.device, dtype=q.dtype).masked_fill(pad_mask[:, None, None], float("-inf"))
        if need_weights:
            w = ((q @ k.transpose(-1, -2)) * (d // self.h) ** -0.5 + bias).softmax(-1)
            y = w @ v
        else:
            w = None
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        x = x + self.out(y.transpose(1, 2).reshape(B, T, d))
        return x + self.ff(self.ln2(x)), w


class ProteinLM(nn.Module):
    def __init__(self, d=640, layers=12, heads=16, max_len=1024):
        super().__init__()
        self.embed = nn.Embedding(len(TOKENS), d, padding_idx=PAD)
        self.pos = nn.Embedding(max_len + 2, d)
        self.layers = nn.ModuleList([Layer(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, len(TOKENS))
        self.contact_head = ContactPredictionHead(layers * heads)

    def forward(self, tokens, return_contacts=False):
        pad = tokens.eq(PAD)
        x = self.embed(tokens) + self.pos(torch.arange(tokens.size(1), device=tokens.device))
        attns = []
        for layer in self.layers:
            x, w = layer(x, pad, return_contacts)
            attns.append(w)
        out = {"logits": self.lm_head(self.ln_f(x))}
        if return_contacts:
            out["contacts"] = self.contact_head(torch.stack(attns, 1))
        return out


def mask(tokens, p=0.15):
    cand = tokens > UNK
    cand &= tokens != MASK
    sel = (torch.rand(tokens.shape, device=tokens.device) < p) & cand
    labels = tokens.masked_fill(~sel, -100)
    return tokens.masked_fill(sel, MASK), labels


@torch.no_grad()
def evaluate(model, dataset, device, rank, world, min_sep=24):
    model.eval()
    acc = torch.zeros(4, device=device)   # mlm loss sum, masked tokens, P@L sum, proteins
    gen = torch.Generator().manual_seed(0)
    for i in range(rank, len(dataset), world):
        tok, cmap = dataset[i]
        tokens = tok[None].to(device)
        keep = torch.rand(tokens.shape, generator=gen).to(device) < 0.15
        keep &= tokens > UNK
        inp = tokens.masked_fill(keep, MASK)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(inp, return_contacts=False)
            contacts = model(tokens, return_contacts=True)["contacts"][0].float()
        acc[0] += F.cross_entropy(out["logits"][0].float()[keep[0]], tokens[0][keep[0]], reduction="sum")
        acc[1] += keep.sum()
        cmap = cmap.to(device)
        L = cmap.size(0)
        r, c = torch.triu_indices(L, L, offset=min_sep, device=device)
        p, t = contacts[r, c], cmap[r, c]
        ok = t >= 0
        if ok.any():
            top = p[ok].topk(min(L, int(ok.sum()))).indices
            acc[2] += t[ok][top].mean()
            acc[3] += 1
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1].clamp_min(1)).item(), (acc[2] / acc[3].clamp_min(1)).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--uniref", required=True)
    ap.add_argument("--pdb", required=True)
    ap.add_argument("--valid-pdb", required=True)
    ap.add_argument("--out", default="runs/esm_contact_aux")
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--contact-weight", type=float, default=0.5)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--epochs", type=int, default=4)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    data = ConcatDataset([UnirefSeqs(args.uniref, args.max_len), PDBContacts(args.pdb, args.max_len)])
    sampler = DistributedSampler(data, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                        num_workers=6, pin_memory=True, drop_last=True)
    valid = PDBContacts(args.valid_pdb, args.max_len)

    model = ProteinLM(max_len=args.max_len).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * len(loader),
                                                pct_start=0.02, anneal_strategy="linear")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        stats = torch.zeros(3, device=device)
        for tokens, contacts in loader:
            tokens = tokens.to(device, non_blocking=True)
            inp, labels = mask(tokens)
            has_structure = contacts is not None
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(inp, return_contacts=has_structure)
            loss = F.cross_entropy(out["logits"].float().flatten(0, 1), labels.flatten(), ignore_index=-100)
            stats[0] += loss.detach()
            if has_structure:
                contacts = contacts.to(device, non_blocking=True)
                valid = contacts >= 0
                c_loss = F.binary_cross_entropy_with_logits(out["contacts"].float()[valid], contacts[valid])
                loss = loss + args.contact_weight * c_loss
                stats[1] += c_loss.detach()
                stats[2] += 1
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % 200 == 0:
                dist.all_reduce(stats)
                if rank == 0:
                    n_c = max(stats[2].item(), 1)
                    print(f"epoch {epoch} step {step} mlm {stats[0].item() / (200 * world):.4f} "
                          f"contact {stats[1].item() / n_c:.4f} ({time.time() - t0:.0f}s)", flush=True)
                stats.zero_()

        v_mlm, v_pl = evaluate(model.module, valid, device, rank, world)
        if rank == 0:
            print(f"epoch {epoch} valid mlm {v_mlm:.4f} long-range P@L {v_pl:.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                        "epoch": epoch, "step": step}, os.path.join(args.out, f"epoch{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
