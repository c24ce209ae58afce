"""Retrosynthesis on USPTO-full (Dai et al. split) with random-SMILES augmentation.

Raw reactions are atom-mapped; we strip maps, canonicalise, drop reactions whose
product appears among reactants and cache the cleaned set so later runs skip it.

torchrun --nnodes=1 --nproc_per_node=4 03_uspto_full_retro.py \
    --raw data/uspto_full/raw_train.csv --cache data/uspto_full/cache
"""
import argparse
import contextlib
import math
import os
import pickle
import random
import re

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from rdkit import Chem, RDLogger
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

RDLogger.DisableLog("rdApp.*")

TOKEN_RE = re.compile(r"(\[[^\]]+]|Br?|Cl?|N|O|S|P|F|I|b|c|n|o|s|p|\(|\)|\.|=|#|-|\+|\\|\/|:|~|@|\?|>|\*|\$|\%[0-9]{2}|[0-9])")


def strip_and_canonicalise(smi):
    mol = Chem.MolFromSmiles(smi)
    if mol is None:
        return None
    for atom in mol.GetAtoms():
        atom.SetAtomMapNum(0)
    return Chem.MolToSmiles(mol)


def clean_reactions(raw_csv):
    df = pd.read_csv(raw_csv)
    out = []
    for rxn in tqdm(df["reactants>reagents>production"], desc="canonicalising", mininterval=30):
        reac, _, prod = rxn.split(">")
        reac_c, prod_c = strip_and_canonicalise(reac), strip_and_canonicalise(prod)
        if not reac_c or not prod_c or prod_c in reac_c.split("."):
            continue
        out.append((prod_c, reac_c))
    return out


def load_split(raw_csv, cache_dir):
    name = os.path.splitext(os.path.basename(raw_csv))[0]
    cache_file = os.path.join(cache_dir, f"{name}.canon.pkl")
    if os.path.exists(cache_file):
        with open(cache_file, "rb") as f:
            return pickle.load(f)
    data = clean_reactions(raw_csv)
    os.makedirs(cache_dir, exist_ok=True)
    with open(cache_file, "wb") as f:
        pickle.dump(data, f, protocol=pickle.HIGHEST_PROTOCOL)
    return data


class SmilesVocab:
    SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>"]

    def __init__(self, tokens):
        self.itos = self.SPECIAL + sorted(tokens)
        self.stoi = {t: i for i, t in enumerate(self.itos)}

    @classmethod
    def build(cls, pairs):
        toks = set()
        for p, r in pairs:
            toks.update(TOKEN_RE.findall(p))
            toks.update(TOKEN_RE.findall(r))
        return cls(toks)

    def __len__(self):
        return len(self.itos)

    def encode(self, smi):
        return [1] + [self.stoi.get(t, 3) for t in TOKEN_RE.findall(smi)] + [2]


class AugmentedPairs(Dataset):
    def __init__(self, pairs, vocab, augment=True):
        self.pairs, self.vocab, self.aug = pairs, vocab, augment

    def __len__(self):
        return len(self.pairs)

    @staticmethod
    def _random_smiles(smi):
        frags = smi.split(".")
        random.shuffle(frags)
        out = []
        for f in frags:
            m = Chem.MolFromSmiles(f)
            out.append(Chem.MolToSmiles(m, doRandom=True, canonical=False) if m else f)
        return ".".join(out)

    def __getitem__(self, i):
        prod, reac = self.pairs[i]
        if self.aug:
            prod, reac = self._random_smiles(prod), self._random_smiles(reac)
        return torch.tensor(self.vocab.encode(prod)), torch.tensor(self.vocab.encode(reac))


def pad_batch(batch):
    s, t = zip(*batch)
    return nn.utils.rnn.pad_sequence(s, True, 0), nn.utils.rnn.pad_sequence(t, True, 0)


class Seq2Seq(nn.Module):
    def __init__(self, n_vocab, d=512, h=8, enc=6, dec=6, ff=2048, p=0.1):
        super().__init__()
        self.d = d
        self.tok = nn.Embedding(n_vocab, d, padding_idx=0)
        self.pos = nn.Embedding(512, d)
        self.net = nn.Transformer(d, h, enc, dec, ff, p, batch_first=True, norm_first=True)
        self.head = nn.Linear(d, n_vocab)

    def embed(self, x):
        pos = torch.arange(x.size(1), device=x.device)
        return self.tok(x) * math.sqrt(self.d) + self.pos(pos)[None]

    def forward(self, src, tgt):
        causal = self.net.generate_square_subsequent_mask(tgt.size(1), device=src.device)
        h = self.net(self.embed(src), self.embed(tgt), tgt_mask=causal,
                     src_key_padding_mask=src.eq(0), tgt_key_padding_mask=tgt.eq(0),
                     memory_key_padding_mask=src.eq(0))
        return self.head(h)


@torch.no_grad()
def token_accuracy(model, loader, device):
    model.eval()
    acc = torch.zeros(4, device=device)  # correct tokens, tokens, exact seqs, seqs
    for src, tgt in loader:
        src, tgt = src.to(device), tgt.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(src, tgt[:, :-1])
        pred, gold = logits.argmax(-1), tgt[:, 1:]
        mask = gold.ne(0)
        hit = pred.eq(gold) & mask
        acc[0] += hit.sum()
        acc[1] += mask.sum()
        acc[2] += (hit | ~mask).all(dim=1).sum()
        acc[3] += gold.size(0)
    dist.all_reduce(acc)
    return (acc[0] / acc[1]).item(), (acc[2] / acc[3]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--raw", required=True)
    ap.add_argument("--raw_val", default="data/uspto_full/raw_val.csv")
    ap.add_argument("--cache", required=True)
    ap.add_argument("--ckpt_dir", default="ckpt/uspto_full")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--bs", type=int, default=128)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup_steps", type=int, default=4000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(0)

    train_pairs = load_split(args.raw, args.cache)
    val_pairs = load_split(args.raw_val, args.cache)
    vocab = SmilesVocab.build(train_pairs + val_pairs)

    train_set = AugmentedPairs(train_pairs, vocab)
    val_set = AugmentedPairs(val_pairs, vocab, augment=False)
    sampler = DistributedSampler(train_set, shuffle=True)
    train_dl = DataLoader(train_set, args.bs, sampler=sampler, num_workers=8, collate_fn=pad_batch,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_set, 256, sampler=DistributedSampler(val_set, shuffle=False),
                        num_workers=4, collate_fn=pad_batch)

    model = DDP(Seq2Seq(len(vocab)).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(train_dl) // args.accum
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total,
                                                pct_start=args.warmup_steps / total, anneal_strategy="cos")
    loss_fn = nn.CrossEntropyLoss(ignore_index=0, label_smoothing=0.1)
    if rank == 0:
        print(f"{len(train_pairs)} train / {len(val_pairs)} val reactions, vocab {len(vocab)}, world {world}")

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for it, (src, tgt) in enumerate(train_dl):
            src, tgt = src.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
            sync = (it + 1) % args.accum == 0
            ctx = contextlib.nullcontext() if sync else model.no_sync()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(src, tgt[:, :-1])
                    loss = loss_fn(logits.float().reshape(-1, logits.size(-1)), tgt[:, 1:].reshape(-1))
                (loss / args.accum).backward()
            if sync:
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
            if rank == 0 and it % 500 == 0:
                print(f"ep {epoch} it {it}/{len(train_dl)} loss {loss.item():.4f}", flush=True)

        tok_acc, seq_acc = token_accuracy(model, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch}: val token acc {tok_acc:.4f}  teacher-forced exact {seq_acc:.4f}", flush=True)
            os.makedirs(args.ckpt_dir, exist_ok=True)
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "vocab": vocab.itos},
                       os.path.join(args.ckpt_dir, f"epoch_{epoch:03d}.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
