"""Retro model training with beam-search top-k and SMILES validity tracking.

Metrics written to <out>/metrics.csv every eval:
  top-k exact match (canonical reactant set), invalid-SMILES rate of top-1,
  and top-k "superset" match (gold reactants contained in the prediction).

torchrun --nproc_per_node=8 18_retro_topk_validity.py --data data/uspto50k --out runs/retro_topk
"""
import argparse
import csv
import logging
import math
import os
import random
import re
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from rdkit import Chem, RDLogger
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

RDLogger.DisableLog("rdApp.*")
logger = logging.getLogger("retro")
TOKENS = re.compile(r"(\[[^\]]+]|Br?|Cl?|N|O|S|P|F|I|b|c|n|o|s|p|\(|\)|\.|=|#|-|\+|\\|\/|:|~|@|\?|>|\*|\$|\%[0-9]{2}|[0-9])")
KS = (1, 3, 5, 10)


def canonical_set(smi):
    out = set()
    for frag in smi.split("."):
        m = Chem.MolFromSmiles(frag)
        if m is None:
            return None
        out.add(Chem.MolToSmiles(m))
    return frozenset(out)


def load(csv_path):
    df = pd.read_csv(csv_path)
    rows = []
    for rxn in df["reactants>reagents>production"]:
        r, _, p = rxn.split(">")
        pm, rm = Chem.MolFromSmiles(p), Chem.MolFromSmiles(r)
        if pm is None or rm is None:
            continue
        for m in (pm, rm):
            [a.SetAtomMapNum(0) for a in m.GetAtoms()]
        rows.append((Chem.MolToSmiles(pm), Chem.MolToSmiles(rm)))
    return rows


class Pairs(Dataset):
    def __init__(self, rows, stoi, augment):
        self.rows, self.stoi, self.augment = rows, stoi, augment

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        p, r = self.rows[i]
        if self.augment:
            p = Chem.MolToSmiles(Chem.MolFromSmiles(p), doRandom=True, canonical=False)
        f = lambda s: torch.tensor([1] + [self.stoi.get(t, 3) for t in TOKENS.findall(s)] + [2])
        return f(p), f(r), i


def collate(b):
    s, t, i = zip(*b)
    return nn.utils.rnn.pad_sequence(s, True), nn.utils.rnn.pad_sequence(t, True), torch.tensor(i)


class Seq2Seq(nn.Module):
    def __init__(self, V, d=256, L=6, H=8, p=0.1):
        super().__init__()
        self.d = d
        self.emb = nn.Embedding(V, d, padding_idx=0)
        self.pos = nn.Embedding(400, d)
        self.t = nn.Transformer(d, H, L, L, 2048, p, batch_first=True)
        self.fc = nn.Linear(d, V)

    def e(self, x):
        return self.emb(x) * math.sqrt(self.d) + self.pos(torch.arange(x.size(1), device=x.device))

    def encode(self, s):
        return self.t.encoder(self.e(s), src_key_padding_mask=s.eq(0))

    def decode(self, y, mem, sp):
        msk = nn.Transformer.generate_square_subsequent_mask(y.size(1), device=y.device)
        return self.fc(self.t.decoder(self.e(y), mem, tgt_mask=msk, tgt_key_padding_mask=y.eq(0),
                                      memory_key_padding_mask=sp))

    def forward(self, s, y):
        return self.decode(y, self.encode(s), s.eq(0))


@torch.no_grad()
def beam(net, src, k, max_len=200):
    B, dev = src.size(0), src.device
    mem, sp = net.encode(src).repeat_interleave(k, 0), src.eq(0).repeat_interleave(k, 0)
    ys = torch.ones(B * k, 1, dtype=torch.long, device=dev)
    sc = torch.full((B, k), float("-inf"), device=dev)
    sc[:, 0] = 0.0
    fin = torch.zeros(B * k, dtype=torch.bool, device=dev)
    for _ in range(max_len):
        lp = F.log_softmax(net.decode(ys, mem, sp)[:, -1], -1)
        lp[fin] = float("-inf")
        lp[fin, 0] = 0.0
        V = lp.size(1)
        sc, fl = (sc.view(-1, 1) + lp).view(B, -1).topk(k, -1)
        par = (fl.div(V, rounding_mode="floor") + torch.arange(B, device=dev)[:, None] * k).view(-1)
        ys = torch.cat([ys[par], (fl % V).view(-1, 1)], 1)
        fin = fin[par] | ys[:, -1].eq(2)
        if fin.all():
            break
    return ys.view(B, k, -1).tolist()


def to_smi(ids, itos):
    out = []
    for t in ids[1:]:
        if t == 2:
            break
        if t > 3:
            out.append(itos[t])
    return "".join(out)


def evaluate(net, loader, rows, itos, device, k):
    net.eval()
    exact, superset = np.zeros(len(KS)), np.zeros(len(KS))
    invalid, n = 0, 0
    for src, _, idx in loader:
        for cands, i in zip(beam(net, src.to(device), k), idx.tolist()):
            gold = canonical_set(rows[i][1])
            preds = [canonical_set(to_smi(c, itos)) for c in cands]
            invalid += preds[0] is None
            first_exact = next((j for j, p in enumerate(preds) if p == gold), k)
            first_sup = next((j for j, p in enumerate(preds) if p is not None and gold <= p), k)
            exact += [first_exact < kk for kk in KS]
            superset += [first_sup < kk for kk in KS]
            n += 1
    net.train()
    out = {f"top{kk}": exact[j] / n for j, kk in enumerate(KS)}
    out.update({f"sup_top{kk}": superset[j] / n for j, kk in enumerate(KS)})
    out["invalid_top1"] = invalid / n
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/retro_topk")
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--batch_size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--beam", type=int, default=10)
    ap.add_argument("--eval_every", type=int, default=10)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1)
    random.seed(1 + rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")

    with open(os.path.join(args.data, "vocab.txt")) as f:
        itos = [l.rstrip("\n") for l in f]
    stoi = {t: i for i, t in enumerate(itos)}
    train_rows = load(os.path.join(args.data, "raw_train.csv"))
    val_rows = load(os.path.join(args.data, "raw_val.csv"))
    train_ds, val_ds = Pairs(train_rows, stoi, True), Pairs(val_rows, stoi, False)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, collate_fn=collate, num_workers=4,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, 50, sampler=DistributedSampler(val_ds, shuffle=False), collate_fn=collate,
                        num_workers=2)

    model = DDP(Seq2Seq(len(itos)).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.998))
    crit = nn.CrossEntropyLoss(ignore_index=0, label_smoothing=0.1)

    csv_file, writer = None, None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        csv_file = open(os.path.join(args.out, "metrics.csv"), "a", newline="")
        writer = csv.writer(csv_file)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for src, tgt, _ in train_dl:
            src, tgt = src.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
            logits = model(src, tgt[:, :-1])
            loss = crit(logits.flatten(0, 1), tgt[:, 1:].flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        logger.info("epoch %d loss %.4f (%.0fs)", epoch, loss.item(), time.time() - t0)

        if (epoch + 1) % args.eval_every == 0:
            m = evaluate(model.module, val_dl, val_rows, itos, device, args.beam)
            if rank == 0:
                logger.info("epoch %d val %s", epoch, " ".join(f"{k}={v:.4f}" for k, v in m.items()))
                writer.writerow([epoch] + [f"{m[k]:.5f}" for k in sorted(m)])
                csv_file.flush()
                if m["top1"] > best:
                    best = m["top1"]
                    torch.save({"model": model.module.state_dict(), "epoch": epoch, "metrics": m},
                               os.path.join(args.out, "best.pt"))
            dist.barrier()
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "last.pt"))

    if csv_file is not None:
        csv_file.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
