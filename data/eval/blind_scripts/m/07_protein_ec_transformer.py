"""
Enzyme Commission (first digit, 7 classes) prediction from protein sequence with a small
transformer encoder. Sequences come from a UniProt/Swiss-Prot FASTA export, labels from a TSV.

  torchrun --nproc_per_node=4 07_protein_ec_transformer.py \
      --fasta data/swissprot_enzymes.fasta --labels data/ec_labels.tsv --max_len 1000
"""
import argparse
import math
import os
import pickle
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

AA = "ACDEFGHIKLMNPQRSTVWY"
PAD, UNK, CLS = 0, 1, 2
AA_TO_ID = {a: i + 3 for i, a in enumerate(AA)}
VOCAB = len(AA) + 3


def read_fasta(path):
    seqs, name, buf = {}, None, []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith(">"):
                if name is not None:
                    seqs[name] = "".join(buf)
                name = line[1:].split("|")[1] if "|" in line else line[1:].split()[0]
                buf = []
            else:
                buf.append(line)
    if name is not None:
        seqs[name] = "".join(buf)
    return seqs


def tokenize(seq, max_len):
    ids = [CLS] + [AA_TO_ID.get(a, UNK) for a in seq[: max_len - 1]]
    return np.array(ids, dtype=np.int16)


def build_or_load_cache(fasta, label_tsv, max_len, cache_dir, verbose=True):
    cache_path = os.path.join(cache_dir, f"ec_tok_len{max_len}.pkl")
    if os.path.exists(cache_path):
        with open(cache_path, "rb") as f:
            return pickle.load(f)
    seqs = read_fasta(fasta)
    lab = pd.read_csv(label_tsv, sep="\t")  # columns: accession, ec, split
    records = {"train": [], "valid": [], "test": []}
    for acc, ec, split in tqdm(lab[["accession", "ec", "split"]].itertuples(index=False),
                               total=len(lab), disable=not verbose, desc="tokenizing"):
        if acc not in seqs:
            continue
        records[split].append((tokenize(seqs[acc], max_len), int(str(ec).split(".")[0]) - 1))
    os.makedirs(cache_dir, exist_ok=True)
    with open(cache_path, "wb") as f:
        pickle.dump(records, f, protocol=pickle.HIGHEST_PROTOCOL)
    return records


class SeqDataset(Dataset):
    def __init__(self, recs):
        self.recs = recs

    def __len__(self):
        return len(self.recs)

    def __getitem__(self, i):
        toks, y = self.recs[i]
        return torch.from_numpy(toks.astype(np.int64)), y


def pad_collate(batch):
    L = max(t.shape[0] for t, _ in batch)
    x = torch.full((len(batch), L), PAD, dtype=torch.long)
    for i, (t, _) in enumerate(batch):
        x[i, : t.shape[0]] = t
    y = torch.tensor([b[1] for b in batch], dtype=torch.long)
    return x, y


class PositionalEncoding(nn.Module):
    def __init__(self, d, max_len=2048):
        super().__init__()
        pe = torch.zeros(max_len, d)
        pos = torch.arange(max_len).unsqueeze(1)
        div = torch.exp(torch.arange(0, d, 2) * (-math.log(10000.0) / d))
        pe[:, 0::2] = torch.sin(pos * div)
        pe[:, 1::2] = torch.cos(pos * div)
        self.register_buffer("pe", pe, persistent=False)

    def forward(self, x):
        return x + self.pe[: x.shape[1]]


class ProtTransformer(nn.Module):
    def __init__(self, d=256, heads=8, layers=6, n_classes=7, dropout=0.1):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d, padding_idx=PAD)
        self.pos = PositionalEncoding(d)
        enc_layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(enc_layer, layers)
        self.norm = nn.LayerNorm(d)
        self.cls = nn.Linear(d, n_classes)

    def forward(self, x):
        mask = x == PAD
        h = self.encoder(self.pos(self.emb(x)), src_key_padding_mask=mask)
        return self.cls(self.norm(h[:, 0]))


@torch.no_grad()
def evaluate(model, loader, device, world):
    model.eval()
    ys, ps = [], []
    for x, y in loader:
        logits = model(x.to(device))
        ps.append(logits.argmax(-1).cpu())
        ys.append(y)
    ys, ps = torch.cat(ys).numpy(), torch.cat(ps).numpy()
    gathered = [None] * world
    dist.all_gather_object(gathered, (ys, ps))
    ys = np.concatenate([g[0] for g in gathered])
    ps = np.concatenate([g[1] for g in gathered])
    return (ys == ps).mean(), f1_score(ys, ps, average="macro")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fasta", required=True)
    ap.add_argument("--labels", required=True)
    ap.add_argument("--max_len", type=int, default=1000)
    ap.add_argument("--cache_dir", default="cache")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--out", default="runs/ec_transformer")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    records = build_or_load_cache(args.fasta, args.labels, args.max_len, args.cache_dir, verbose=(rank == 0))
    train_ds, val_ds = SeqDataset(records["train"]), SeqDataset(records["valid"])
    if rank == 0:
        print(f"train {len(train_ds)}  valid {len(val_ds)}")

    tr_sampler = DistributedSampler(train_ds, shuffle=True)
    tr_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=tr_sampler, collate_fn=pad_collate,
                       num_workers=4, pin_memory=True, drop_last=True)
    val_part = torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world))
    va_dl = DataLoader(val_part, batch_size=64, collate_fn=pad_collate, num_workers=2)

    model = DDP(ProtTransformer().to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(tr_dl)
    warm = int(0.05 * total)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * max(0.0, (total - s) / max(1, total - warm)))

    os.makedirs(args.out, exist_ok=True)
    best_f1 = 0.0
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_acc = torch.zeros(2, device=device)
        for x, y in tqdm(tr_dl, disable=rank != 0, desc=f"ep{epoch}"):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            loss_acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(loss_acc)
        acc, f1 = evaluate(model.module, va_dl, device, world)
        if rank == 0:
            print(f"epoch {epoch} loss {(loss_acc[0] / loss_acc[1]).item():.4f} "
                  f"val acc {acc:.4f} macro-F1 {f1:.4f} ({time.time() - t0:.0f}s)")
            if f1 > best_f1:
                best_f1 = f1
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
