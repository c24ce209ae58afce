"""Reagent / condition prediction: reactants>>product -> reagents (solvents, catalysts, bases).

Targets are the dot-joined reagent set in a fixed canonical order, so the model
is scored by exact set match and by per-molecule recall.

Usage:
    torchrun --nproc_per_node=4 13_reagent_prediction.py --data data/uspto_reagents --save runs/reagents
"""
import argparse
import json
import math
import os
import random
import re

import torch
import torch.distributed as dist
import torch.nn as nn
from rdkit import Chem, RDLogger
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

RDLogger.DisableLog("rdApp.*")
RX = re.compile(r"(\[[^\]]+]|Br?|Cl?|N|O|S|P|F|I|b|c|n|o|s|p|\(|\)|\.|=|#|-|\+|\\|\/|:|~|@|\?|>|\*|\$|\%[0-9]{2}|[0-9])")


def get_args():
    p = argparse.ArgumentParser(description="reagent prediction")
    p.add_argument("--data", required=True)
    p.add_argument("--save", default="runs/reagents")
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--batch_size", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--d_model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--augment", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def canon_set(smi):
    mols = []
    for frag in smi.split("."):
        m = Chem.MolFromSmiles(frag)
        if m is not None:
            mols.append(Chem.MolToSmiles(m))
    return sorted(set(mols))


class ReagentData(Dataset):
    def __init__(self, path, stoi, augment=0.0):
        with open(path) as f:
            self.records = [json.loads(l) for l in f]
        self.stoi, self.augment = stoi, augment

    def __len__(self):
        return len(self.records)

    def enc(self, s):
        return [1] + [self.stoi.get(t, 3) for t in RX.findall(s)] + [2]

    def __getitem__(self, i):
        r = self.records[i]
        reactants, product = r["reactants"], r["product"]
        if self.augment and random.random() < self.augment:
            frags = [Chem.MolToSmiles(Chem.MolFromSmiles(x), doRandom=True, canonical=False)
                     for x in reactants.split(".")]
            random.shuffle(frags)
            reactants = ".".join(frags)
            product = Chem.MolToSmiles(Chem.MolFromSmiles(product), doRandom=True, canonical=False)
        src = reactants + ">>" + product
        tgt = ".".join(canon_set(r["reagents"]))
        return torch.tensor(self.enc(src)), torch.tensor(self.enc(tgt)), i


def collate(batch):
    s, t, i = zip(*batch)
    return nn.utils.rnn.pad_sequence(s, True), nn.utils.rnn.pad_sequence(t, True), torch.tensor(i)


class ReagentTransformer(nn.Module):
    def __init__(self, V, d, L, heads=8, drop=0.1):
        super().__init__()
        self.scale = math.sqrt(d)
        self.emb = nn.Embedding(V, d, padding_idx=0)
        self.pos = nn.Embedding(600, d)
        self.body = nn.Transformer(d, heads, L, L, 4 * d, drop, batch_first=True, norm_first=True)
        self.head = nn.Linear(d, V)

    def e(self, x):
        return self.emb(x) * self.scale + self.pos(torch.arange(x.size(1), device=x.device))

    def forward(self, src, tgt):
        m = nn.Transformer.generate_square_subsequent_mask(tgt.size(1), device=tgt.device)
        return self.head(self.body(self.e(src), self.e(tgt), tgt_mask=m, src_key_padding_mask=src.eq(0),
                                   tgt_key_padding_mask=tgt.eq(0), memory_key_padding_mask=src.eq(0)))

    @torch.no_grad()
    def greedy(self, src, max_len=120):
        mem = self.body.encoder(self.e(src), src_key_padding_mask=src.eq(0))
        ys = torch.ones(src.size(0), 1, dtype=torch.long, device=src.device)
        done = torch.zeros(src.size(0), dtype=torch.bool, device=src.device)
        for _ in range(max_len):
            m = nn.Transformer.generate_square_subsequent_mask(ys.size(1), device=src.device)
            h = self.body.decoder(self.e(ys), mem, tgt_mask=m, memory_key_padding_mask=src.eq(0))
            nxt = self.head(h[:, -1]).argmax(-1).masked_fill(done, 0)
            ys = torch.cat([ys, nxt[:, None]], 1)
            done |= nxt.eq(2)
            if done.all():
                break
        return ys


def decode(ids, itos):
    out = []
    for t in ids[1:]:
        if t in (0, 2):
            break
        out.append(itos[t])
    return "".join(out)


@torch.no_grad()
def evaluate(net, loader, ds, itos, device):
    net.eval()
    s = torch.zeros(4, device=device)  # exact set, recalled molecules, gold molecules, reactions
    for src, _, idx in loader:
        out = net.greedy(src.to(device))
        for seq, i in zip(out.tolist(), idx.tolist()):
            pred = set(canon_set(decode(seq, itos)))
            gold = set(canon_set(ds.records[i]["reagents"]))
            s[0] += float(pred == gold)
            s[1] += len(pred & gold)
            s[2] += len(gold)
            s[3] += 1
    dist.all_reduce(s)
    net.train()
    return {"exact": (s[0] / s[3]).item(), "recall": (s[1] / s[2].clamp(min=1)).item()}


def main():
    args = get_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    device = torch.device("cuda", args.local_rank)
    torch.manual_seed(args.seed)
    random.seed(args.seed + rank)

    with open(os.path.join(args.data, "vocab.json")) as f:
        itos = json.load(f)
    stoi = {t: i for i, t in enumerate(itos)}
    train_ds = ReagentData(os.path.join(args.data, "train.jsonl"), stoi, args.augment)
    val_ds = ReagentData(os.path.join(args.data, "val.jsonl"), stoi)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, collate_fn=collate, num_workers=4,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, 256, sampler=DistributedSampler(val_ds, shuffle=False), collate_fn=collate,
                        num_workers=2)

    net = ReagentTransformer(len(itos), args.d_model, args.layers).to(device)
    model = DDP(net, device_ids=[args.local_rank], output_device=args.local_rank)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, epochs=args.epochs,
                                                steps_per_epoch=len(train_dl), pct_start=0.05)
    crit = nn.CrossEntropyLoss(ignore_index=0, label_smoothing=0.05)

    if rank == 0:
        os.makedirs(args.save, exist_ok=True)
        print(f"world={dist.get_world_size()} train={len(train_ds)} val={len(val_ds)}", flush=True)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for it, (src, tgt, _) in enumerate(train_dl):
            src, tgt = src.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
            logits = model(src, tgt[:, :-1])
            loss = crit(logits.flatten(0, 1), tgt[:, 1:].flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 2.0)
            opt.step()
            sched.step()
            if rank == 0 and it % 250 == 0:
                print(f"[{epoch}:{it}] loss {loss.item():.4f}", flush=True)

        metrics = evaluate(net, val_dl, val_ds, itos, device)
        if rank == 0:
            print(f"epoch {epoch}: exact {metrics['exact']:.4f} recall {metrics['recall']:.4f}", flush=True)
            torch.save({"model": net.state_dict(), "epoch": epoch, "metrics": metrics},
                       os.path.join(args.save, "last.pt"))
            if metrics["exact"] > best:
                best = metrics["exact"]
                torch.save({"model": net.state_dict(), "epoch": epoch, "metrics": metrics},
                           os.path.join(args.save, "best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
