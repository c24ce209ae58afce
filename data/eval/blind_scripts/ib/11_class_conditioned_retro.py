"""Reaction-class conditioned retrosynthesis (USPTO-50k, 10 classes).

The class embedding is dropped for a fraction of the batches so the same model
can be queried with or without a known reaction class at inference time.
Initialises from a product->reactants model pretrained on USPTO-full.

torchrun --nproc_per_node=4 11_class_conditioned_retro.py \
    --data data/uspto50k --init runs/uspto_full/best.pt --out runs/cond50k
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
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

RDLogger.DisableLog("rdApp.*")
PAT = re.compile(r"(\[[^\]]+]|Br?|Cl?|N|O|S|P|F|I|b|c|n|o|s|p|\(|\)|\.|=|#|-|\+|\\|\/|:|~|@|\?|>|\*|\$|\%[0-9]{2}|[0-9])")
PAD, BOS, EOS, UNK = 0, 1, 2, 3


def unmap_canonical(smi):
    m = Chem.MolFromSmiles(smi)
    if m is None:
        return None
    for a in m.GetAtoms():
        a.SetAtomMapNum(0)
    return Chem.MolToSmiles(m)


class Uspto50k(Dataset):
    def __init__(self, csv, stoi, augment):
        df = pd.read_csv(csv)
        self.rows = []
        for rxn, cls in zip(df["reactants>reagents>production"], df["class"]):
            r, _, p = rxn.split(">")
            r, p = unmap_canonical(r), unmap_canonical(p)
            if r and p:
                self.rows.append((p, r, int(cls) - 1))
        self.stoi, self.augment = stoi, augment

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        p, r, c = self.rows[i]
        if self.augment:
            p = Chem.MolToSmiles(Chem.MolFromSmiles(p), doRandom=True, canonical=False)
        enc = lambda s: [BOS] + [self.stoi.get(t, UNK) for t in PAT.findall(s)] + [EOS]
        return torch.tensor(enc(p)), torch.tensor(enc(r)), c, i


def collate(batch):
    s, t, c, i = zip(*batch)
    return (nn.utils.rnn.pad_sequence(s, True, PAD), nn.utils.rnn.pad_sequence(t, True, PAD),
            torch.tensor(c), torch.tensor(i))


class CondRetro(nn.Module):
    def __init__(self, V, n_classes=10, d=512, L=6, H=8, drop=0.1):
        super().__init__()
        self.d = d
        self.tok = nn.Embedding(V, d, padding_idx=PAD)
        self.pos = nn.Embedding(512, d)
        self.class_emb = nn.Embedding(n_classes, d)
        self.transformer = nn.Transformer(d, H, L, L, 4 * d, drop, batch_first=True)
        self.proj = nn.Linear(d, V)

    def embed(self, x):
        return self.tok(x) * math.sqrt(self.d) + self.pos(torch.arange(x.size(1), device=x.device))

    def encode(self, src, cls=None):
        h = self.embed(src)
        if cls is not None:
            h = h + self.class_emb(cls)[:, None, :]
        return self.transformer.encoder(h, src_key_padding_mask=src.eq(PAD))

    def decode(self, tgt, mem, src_pad):
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.size(1), device=tgt.device)
        return self.proj(self.transformer.decoder(self.embed(tgt), mem, tgt_mask=mask,
                                                  tgt_key_padding_mask=tgt.eq(PAD), memory_key_padding_mask=src_pad))

    def forward(self, src, tgt, cls=None):
        return self.decode(tgt, self.encode(src, cls), src.eq(PAD))

    @torch.no_grad()
    def beam_search(self, src, cls=None, k=10, max_len=200):
        B, dev = src.size(0), src.device
        mem = self.encode(src, cls).repeat_interleave(k, 0)
        spad = src.eq(PAD).repeat_interleave(k, 0)
        seq = torch.full((B * k, 1), BOS, dtype=torch.long, device=dev)
        lp_sum = torch.full((B, k), float("-inf"), device=dev)
        lp_sum[:, 0] = 0.0
        over = torch.zeros(B * k, dtype=torch.bool, device=dev)
        for _ in range(max_len):
            lp = F.log_softmax(self.decode(seq, mem, spad)[:, -1], -1)
            lp[over] = float("-inf")
            lp[over, PAD] = 0.0
            V = lp.size(-1)
            lp_sum, flat = (lp_sum.view(-1, 1) + lp).view(B, -1).topk(k, -1)
            parent = (torch.div(flat, V, rounding_mode="floor") + torch.arange(B, device=dev)[:, None] * k).view(-1)
            seq = torch.cat([seq[parent], (flat % V).view(-1, 1)], 1)
            over = over[parent] | seq[:, -1].eq(EOS)
            if over.all():
                break
        return seq.view(B, k, -1)


def to_smiles(ids, itos):
    out = []
    for t in ids[1:]:
        if t == EOS:
            break
        if t != PAD:
            out.append(itos[t])
    return "".join(out)


def topk_eval(net, loader, ds, itos, device, beam, use_class):
    net.eval()
    ks = (1, 3, 5, 10)
    counts = torch.zeros(len(ks) + 1, device=device)
    for src, _, cls, idx in loader:
        src, cls = src.to(device), cls.to(device)
        beams = net.beam_search(src, cls if use_class else None, k=beam)
        for b, i in enumerate(idx.tolist()):
            gold = ds.rows[i][1]
            preds = [unmap_canonical(to_smiles(s, itos)) for s in beams[b].tolist()]
            pos = next((j for j, p in enumerate(preds) if p == gold), beam)
            for n, k in enumerate(ks):
                counts[n] += float(pos < k)
            counts[-1] += 1
    dist.all_reduce(counts)
    net.train()
    return {k: (counts[n] / counts[-1]).item() for n, k in enumerate(ks)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--init", default=None)
    ap.add_argument("--out", default="runs/cond50k")
    ap.add_argument("--epochs", type=int, default=150)
    ap.add_argument("--batch_size", type=int, default=48)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--class_dropout", type=float, default=0.2)
    ap.add_argument("--beam", type=int, default=10)
    ap.add_argument("--eval_every", type=int, default=15)
    ap.add_argument("--seed", type=int, default=3)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    random.seed(args.seed * 100 + rank)  # different SMILES randomisations on every rank

    with open(os.path.join(args.data, "vocab.txt")) as f:
        itos = [l.rstrip("\n") for l in f]
    stoi = {t: i for i, t in enumerate(itos)}
    train_ds = Uspto50k(os.path.join(args.data, "raw_train.csv"), stoi, augment=True)
    val_ds = Uspto50k(os.path.join(args.data, "raw_val.csv"), stoi, augment=False)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, collate_fn=collate, num_workers=4,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, 64, sampler=DistributedSampler(val_ds, shuffle=False), collate_fn=collate,
                        num_workers=2)

    net = CondRetro(len(itos))
    if args.init:
        state = torch.load(args.init, map_location="cpu")
        state = state.get("model", state)
        state = {k.removeprefix("module."): v for k, v in state.items()}
        missing, unexpected = net.load_state_dict(state, strict=False)
        if rank == 0:
            print(f"init from {args.init}: missing={missing} unexpected={unexpected}", flush=True)
    net.to(device)
    # class_emb is skipped on class-dropout batches, so some steps leave it without a gradient
    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.998))
    crit = nn.CrossEntropyLoss(ignore_index=PAD, label_smoothing=0.1)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for step, (src, tgt, cls, _) in enumerate(train_dl):
            src, tgt, cls = src.to(device), tgt.to(device), cls.to(device)
            use_cls = random.random() >= args.class_dropout
            logits = model(src, tgt[:, :-1], cls if use_cls else None)
            loss = crit(logits.flatten(0, 1), tgt[:, 1:].flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if rank == 0 and step % 200 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f} class={use_cls}", flush=True)

        if (epoch + 1) % args.eval_every == 0:
            with_cls = topk_eval(model.module, val_dl, val_ds, itos, device, args.beam, use_class=True)
            no_cls = topk_eval(model.module, val_dl, val_ds, itos, device, args.beam, use_class=False)
            if rank == 0:
                print(f"epoch {epoch} class-known top1/5/10 {with_cls[1]:.4f}/{with_cls[5]:.4f}/{with_cls[10]:.4f} "
                      f"class-unknown {no_cls[1]:.4f}/{no_cls[5]:.4f}/{no_cls[10]:.4f}", flush=True)
                if with_cls[1] > best:
                    best = with_cls[1]
                    torch.save({"model": model.module.state_dict(), "itos": itos, "epoch": epoch},
                               os.path.join(args.out, "best.pt"))
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
