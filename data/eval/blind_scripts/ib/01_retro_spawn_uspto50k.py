"""Single-step retrosynthesis on USPTO-50k with a SMILES transformer.

Launched with torch.multiprocessing.spawn (one process per visible GPU), so it
can be started with plain `python` on our workstation nodes.
"""
import argparse
import json
import math
import os
import random
import re
import time

import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from rdkit import Chem, RDLogger
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

RDLogger.DisableLog("rdApp.*")

SMI_REGEX = re.compile(
    r"(\[[^\]]+]|Br?|Cl?|N|O|S|P|F|I|b|c|n|o|s|p|\(|\)|\.|=|#|-|\+|\\|\/|:|~|@|\?|>|\*|\$|\%[0-9]{2}|[0-9])"
)
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
PAD, BOS, EOS, UNK = range(4)


def tokenize(smi):
    return SMI_REGEX.findall(smi)


def canonicalize(smi):
    mol = Chem.MolFromSmiles(smi)
    return Chem.MolToSmiles(mol) if mol is not None else ""


def randomize(smi):
    mol = Chem.MolFromSmiles(smi)
    if mol is None:
        return smi
    return Chem.MolToSmiles(mol, doRandom=True, canonical=False)


def read_split(data_dir, split):
    df = pd.read_csv(os.path.join(data_dir, f"raw_{split}.csv"))
    rxns = df["reactants>reagents>production"].tolist()
    pairs = []
    for rxn in rxns:
        reactants, _, product = rxn.split(">")
        pairs.append((canonicalize(product), canonicalize(reactants)))
    return [p for p in pairs if p[0] and p[1]]


class RetroDataset(Dataset):
    def __init__(self, pairs, stoi, augment=False):
        self.pairs = pairs
        self.stoi = stoi
        self.augment = augment

    def __len__(self):
        return len(self.pairs)

    def encode(self, smi):
        return [BOS] + [self.stoi.get(t, UNK) for t in tokenize(smi)] + [EOS]

    def __getitem__(self, idx):
        prod, reac = self.pairs[idx]
        if self.augment and random.random() < 0.5:
            prod = randomize(prod)
        return idx, torch.tensor(self.encode(prod)), torch.tensor(self.encode(reac))


def collate(batch):
    idx, src, tgt = zip(*batch)
    src = nn.utils.rnn.pad_sequence(src, batch_first=True, padding_value=PAD)
    tgt = nn.utils.rnn.pad_sequence(tgt, batch_first=True, padding_value=PAD)
    return torch.tensor(idx), src, tgt


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, dropout, max_len=512):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        pos = torch.arange(max_len).unsqueeze(1)
        div = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
        pe = torch.zeros(max_len, d_model)
        pe[:, 0::2] = torch.sin(pos * div)
        pe[:, 1::2] = torch.cos(pos * div)
        self.register_buffer("pe", pe.unsqueeze(0))

    def forward(self, x):
        return self.dropout(x + self.pe[:, : x.size(1)])


class RetroTransformer(nn.Module):
    def __init__(self, vocab_size, d_model=256, nhead=8, layers=6, ff=2048, dropout=0.1):
        super().__init__()
        self.d_model = d_model
        self.embed = nn.Embedding(vocab_size, d_model, padding_idx=PAD)
        self.pos = PositionalEncoding(d_model, dropout)
        self.transformer = nn.Transformer(d_model, nhead, layers, layers, ff, dropout, batch_first=True)
        self.out = nn.Linear(d_model, vocab_size)

    def encode(self, src):
        x = self.pos(self.embed(src) * math.sqrt(self.d_model))
        return self.transformer.encoder(x, src_key_padding_mask=src.eq(PAD))

    def decode(self, tgt, memory, src_pad):
        n = tgt.size(1)
        causal = torch.triu(torch.full((n, n), float("-inf"), device=tgt.device), diagonal=1)
        y = self.pos(self.embed(tgt) * math.sqrt(self.d_model))
        h = self.transformer.decoder(y, memory, tgt_mask=causal, tgt_key_padding_mask=tgt.eq(PAD),
                                     memory_key_padding_mask=src_pad)
        return self.out(h)

    def forward(self, src, tgt_in):
        return self.decode(tgt_in, self.encode(src), src.eq(PAD))


@torch.no_grad()
def beam_search(model, src, beam, max_len=200):
    B, dev = src.size(0), src.device
    memory = model.encode(src).repeat_interleave(beam, 0)
    src_pad = src.eq(PAD).repeat_interleave(beam, 0)
    ys = torch.full((B * beam, 1), BOS, dtype=torch.long, device=dev)
    scores = torch.zeros(B, beam, device=dev)
    scores[:, 1:] = float("-inf")
    done = torch.zeros(B * beam, dtype=torch.bool, device=dev)
    for _ in range(max_len):
        logp = F.log_softmax(model.decode(ys, memory, src_pad)[:, -1], dim=-1)
        logp[done] = float("-inf")
        logp[done, PAD] = 0.0
        V = logp.size(-1)
        top, idx = (scores.view(-1, 1) + logp).view(B, beam * V).topk(beam, dim=-1)
        origin = torch.div(idx, V, rounding_mode="floor") + (torch.arange(B, device=dev) * beam).unsqueeze(1)
        tok = (idx % V).view(-1, 1)
        ys = torch.cat([ys[origin.view(-1)], tok], dim=1)
        done = done[origin.view(-1)] | tok.view(-1).eq(EOS)
        scores = top
        if done.all():
            break
    return ys.view(B, beam, -1)


def ids_to_smiles(ids, itos):
    toks = []
    for i in ids:
        if i == EOS:
            break
        if i not in (BOS, PAD):
            toks.append(itos[i])
    return "".join(toks)


def evaluate(model, loader, itos, ds, beam, device):
    model.eval()
    local = {}
    for idx, src, _ in loader:
        preds = beam_search(model, src.to(device, non_blocking=True), beam)
        for i, cand in zip(idx.tolist(), preds.tolist()):
            target = ds.pairs[i][1]
            rank = None
            for k, c in enumerate(cand):
                if canonicalize(ids_to_smiles(c, itos)) == target:
                    rank = k
                    break
            local[i] = rank
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    merged = {}
    for part in gathered:
        merged.update(part)  # DistributedSampler pads with repeated indices; dict keys drop them
    topk = {}
    for k in (1, 3, 5, 10):
        if k <= beam:
            topk[k] = sum(1 for r in merged.values() if r is not None and r < k) / len(merged)
    return topk


def build_vocab(pairs, path):
    tokens = set()
    for prod, reac in pairs:
        tokens.update(tokenize(prod))
        tokens.update(tokenize(reac))
    itos = SPECIALS + sorted(tokens)
    with open(path, "w") as f:
        json.dump(itos, f)


def main_worker(rank, world_size, args):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    train_pairs = read_split(args.data_dir, "train")
    val_pairs = read_split(args.data_dir, "val")
    vocab_path = os.path.join(args.save_dir, "vocab.json")
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        if not os.path.exists(vocab_path):
            build_vocab(train_pairs + val_pairs, vocab_path)
    dist.barrier()
    with open(vocab_path) as f:
        itos = json.load(f)
    stoi = {t: i for i, t in enumerate(itos)}

    train_ds = RetroDataset(train_pairs, stoi, augment=args.augment)
    val_ds = RetroDataset(val_pairs, stoi)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=4,
                              collate_fn=collate, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.eval_batch_size, sampler=val_sampler, num_workers=2,
                            collate_fn=collate, pin_memory=True)

    model = RetroTransformer(len(itos)).to(device)
    model = DDP(model, device_ids=[rank], output_device=rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.998), eps=1e-9)
    # Noam schedule; the reference recipe used 4096 sequences per update
    scale = args.batch_size * world_size / 4096
    warmup = max(1, int(args.warmup / scale))
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: scale * 256 ** -0.5 * min((s + 1) ** -0.5, (s + 1) * warmup ** -1.5))
    criterion = nn.CrossEntropyLoss(ignore_index=PAD, label_smoothing=0.1)

    start_epoch, best = 0, 0.0
    ckpt_path = os.path.join(args.save_dir, "last.pt")
    if args.resume and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optim"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]

    for epoch in range(start_epoch, args.epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        t0, running = time.time(), torch.zeros(2, device=device)
        for step, (_, src, tgt) in enumerate(train_loader):
            src, tgt = src.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
            logits = model(src, tgt[:, :-1])
            loss = criterion(logits.reshape(-1, logits.size(-1)), tgt[:, 1:].reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            sched.step()
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(running)
        if rank == 0:
            print(f"epoch {epoch} loss {running[0].item() / running[1].item():.4f} "
                  f"lr {sched.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)

        if (epoch + 1) % args.eval_every == 0:
            topk = evaluate(model.module, val_loader, itos, val_ds, args.beam, device)
            if rank == 0:
                print("val " + " ".join(f"top-{k} {v:.4f}" for k, v in topk.items()), flush=True)
                if topk[1] > best:
                    best = topk[1]
                    torch.save(model.module.state_dict(), os.path.join(args.save_dir, "best.pt"))
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optim": optimizer.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch, "best": best}, ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", default="data/USPTO_50K")
    p.add_argument("--save_dir", default="checkpoints/retro_50k")
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--port", type=int, default=29513)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--eval_batch_size", type=int, default=32)
    p.add_argument("--lr", type=float, default=2.0)
    p.add_argument("--warmup", type=int, default=8000)
    p.add_argument("--beam", type=int, default=10)
    p.add_argument("--eval_every", type=int, default=10)
    p.add_argument("--augment", action="store_true")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


if __name__ == "__main__":
    args = parse_args()
    mp.spawn(main_worker, args=(args.gpus, args), nprocs=args.gpus, join=True)
