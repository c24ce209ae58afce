"""Retrosynthesis transformer with early stopping on validation top-1.

Validation is a quick beam search over a fixed subset of the validation set,
run by rank 0 on the bare module while the other ranks wait.

torchrun --nproc_per_node=4 20_retro_val_subset.py --data data/uspto50k --ckpt_dir ckpt/es_retro --patience 8
"""
import argparse
import math
import os
import random
import re

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from rdkit import Chem, RDLogger
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

RDLogger.DisableLog("rdApp.*")
SMI = re.compile(r"(\[[^\]]+]|Br?|Cl?|N|O|S|P|F|I|b|c|n|o|s|p|\(|\)|\.|=|#|-|\+|\\|\/|:|~|@|\?|>|\*|\$|\%[0-9]{2}|[0-9])")


def canon(smi, strip_maps=False):
    m = Chem.MolFromSmiles(smi)
    if m is None:
        return None
    if strip_maps:
        for a in m.GetAtoms():
            a.SetAtomMapNum(0)
    return Chem.MolToSmiles(m)


class Retro50k(Dataset):
    def __init__(self, csv, stoi, augment):
        df = pd.read_csv(csv)
        self.data = []
        for rxn in df["reactants>reagents>production"]:
            r, _, p = rxn.split(">")
            r, p = canon(r, True), canon(p, True)
            if r and p:
                self.data.append((p, r))
        self.stoi, self.augment = stoi, augment

    def __len__(self):
        return len(self.data)

    def ids(self, s):
        return [1] + [self.stoi.get(t, 3) for t in SMI.findall(s)] + [2]

    def __getitem__(self, i):
        p, r = self.data[i]
        if self.augment and random.random() < 0.5:
            p = Chem.MolToSmiles(Chem.MolFromSmiles(p), doRandom=True, canonical=False)
        return torch.tensor(self.ids(p)), torch.tensor(self.ids(r)), i


def collate(b):
    s, t, i = zip(*b)
    return nn.utils.rnn.pad_sequence(s, True), nn.utils.rnn.pad_sequence(t, True), torch.tensor(i)


class Model(nn.Module):
    def __init__(self, V, d=256, L=6, H=8, drop=0.1):
        super().__init__()
        self.d = d
        self.emb = nn.Embedding(V, d, padding_idx=0)
        self.pos = nn.Embedding(512, d)
        self.tf = nn.Transformer(d, H, L, L, 2048, drop, batch_first=True)
        self.out = nn.Linear(d, V)

    def e(self, x):
        return self.emb(x) * math.sqrt(self.d) + self.pos(torch.arange(x.size(1), device=x.device))

    def encode(self, src):
        return self.tf.encoder(self.e(src), src_key_padding_mask=src.eq(0))

    def decode(self, y, mem, sp):
        m = nn.Transformer.generate_square_subsequent_mask(y.size(1), device=y.device)
        return self.out(self.tf.decoder(self.e(y), mem, tgt_mask=m, tgt_key_padding_mask=y.eq(0),
                                        memory_key_padding_mask=sp))

    def forward(self, src, y):
        return self.decode(y, self.encode(src), src.eq(0))


@torch.no_grad()
def beam_search(net, src, k, max_len=200):
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
        par = (torch.div(fl, V, rounding_mode="floor") + torch.arange(B, device=dev)[:, None] * k).view(-1)
        ys = torch.cat([ys[par], (fl % V).view(-1, 1)], 1)
        fin = fin[par] | ys[:, -1].eq(2)
        if fin.all():
            break
    return ys.view(B, k, -1)


@torch.no_grad()
def quick_val(net, loader, ds, itos, device, k):
    net.eval()
    hit1, hitk, n = 0, 0, 0
    for src, _, idx in loader:
        beams = beam_search(net, src.to(device), k).tolist()
        for cand, i in zip(beams, idx.tolist()):
            gold = ds.data[i][1]
            preds = [canon("".join(itos[t] for t in c[1:c.index(2)] if t > 3)) if 2 in c else None for c in cand]
            hit1 += int(preds[0] == gold)
            hitk += int(gold in preds)
            n += 1
    net.train()
    return hit1 / n, hitk / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--ckpt_dir", default="ckpt/es_retro")
    ap.add_argument("--epochs", type=int, default=500)
    ap.add_argument("--batch_size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--val_subset", type=int, default=1000)
    ap.add_argument("--beam", type=int, default=5)
    ap.add_argument("--eval_every", type=int, default=5)
    ap.add_argument("--patience", type=int, default=8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    random.seed(rank)

    with open(os.path.join(args.data, "vocab.txt")) as f:
        itos = [l.rstrip("\n") for l in f]
    stoi = {t: i for i, t in enumerate(itos)}
    train_ds = Retro50k(os.path.join(args.data, "raw_train.csv"), stoi, augment=True)
    val_ds = Retro50k(os.path.join(args.data, "raw_val.csv"), stoi, augment=False)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, collate_fn=collate, num_workers=4,
                          pin_memory=True, drop_last=True)
    subset_idx = random.Random(0).sample(range(len(val_ds)), min(args.val_subset, len(val_ds)))
    val_dl = DataLoader(Subset(val_ds, subset_idx), 100, shuffle=False, collate_fn=collate, num_workers=2)

    model = DDP(Model(len(itos)).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.998))
    crit = nn.CrossEntropyLoss(ignore_index=0, label_smoothing=0.1)
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)

    best, bad_evals = -1.0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tot = torch.zeros(2, device=device)
        for src, tgt, _ in train_dl:
            src, tgt = src.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
            logits = model(src, tgt[:, :-1])
            loss = crit(logits.flatten(0, 1), tgt[:, 1:].flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += torch.stack([loss.detach(), torch.ones_like(loss)])
        dist.all_reduce(tot)

        if (epoch + 1) % args.eval_every != 0:
            continue
        if rank == 0:
            top1, topk = quick_val(model.module, val_dl, val_ds, itos, device, args.beam)
            print(f"epoch {epoch} train_loss {(tot[0] / tot[1]).item():.4f} val top1 {top1:.4f} "
                  f"top{args.beam} {topk:.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(args.ckpt_dir, "last.pt"))
            if top1 > best:
                best, bad_evals = top1, 0
                torch.save(model.module.state_dict(), os.path.join(args.ckpt_dir, "best.pt"))
            else:
                bad_evals += 1
                if bad_evals >= args.patience:
                    print(f"no improvement for {bad_evals} evaluations, stopping at epoch {epoch}", flush=True)
                    break
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
