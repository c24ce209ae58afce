"""Forward reaction outcome prediction (reactants + reagents -> major product).

Input: jsonl with {"reactants": ..., "reagents": ..., "product": ...} per line.
Launch: torchrun --standalone --nproc_per_node=8 04_forward_prediction.py --train data/pistachio_fwd/train.jsonl
"""
import argparse
import json
import math
import os
import re
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from rdkit import Chem, RDLogger
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

RDLogger.DisableLog("rdApp.*")

PATTERN = re.compile(r"(\[[^\]]+]|Br?|Cl?|N|O|S|P|F|I|b|c|n|o|s|p|\(|\)|\.|=|#|-|\+|\\|\/|:|~|@|\?|>|\*|\$|\%[0-9]{2}|[0-9])")


def smi_tokens(smi):
    toks = PATTERN.findall(smi)
    assert "".join(toks) == smi, f"untokenizable: {smi}"
    return toks


def read_jsonl(path):
    with open(path) as f:
        rows = [json.loads(l) for l in f if l.strip()]
    data = []
    for r in rows:
        src = r["reactants"] + (">" + r["reagents"] if r.get("reagents") else "")
        data.append((src, r["product"]))
    return data


def build_vocab(pairs):
    tokens = set()
    for src, tgt in pairs:
        tokens.update(smi_tokens(src))
        tokens.update(smi_tokens(tgt))
    itos = ["<pad>", "<s>", "</s>", "<unk>"] + list(tokens)
    return itos, {t: i for i, t in enumerate(itos)}


class ReactionDataset(Dataset):
    def __init__(self, pairs, stoi):
        self.pairs = pairs
        self.stoi = stoi

    def __len__(self):
        return len(self.pairs)

    def _ids(self, smi):
        return [1] + [self.stoi.get(t, 3) for t in smi_tokens(smi)] + [2]

    def __getitem__(self, i):
        src, tgt = self.pairs[i]
        return torch.tensor(self._ids(src)), torch.tensor(self._ids(tgt)), i


def collate(batch):
    src, tgt, idx = zip(*batch)
    return (nn.utils.rnn.pad_sequence(src, batch_first=True), nn.utils.rnn.pad_sequence(tgt, batch_first=True),
            torch.tensor(idx))


class FwdModel(nn.Module):
    def __init__(self, vocab_size, d_model=384, nhead=8, n_enc=6, n_dec=6, dropout=0.1):
        super().__init__()
        self.scale = math.sqrt(d_model)
        self.embedding = nn.Embedding(vocab_size, d_model, padding_idx=0)
        self.positions = nn.Parameter(torch.randn(1, 400, d_model) * 0.02)
        enc_layer = nn.TransformerEncoderLayer(d_model, nhead, 4 * d_model, dropout, batch_first=True, activation="gelu")
        dec_layer = nn.TransformerDecoderLayer(d_model, nhead, 4 * d_model, dropout, batch_first=True, activation="gelu")
        self.encoder = nn.TransformerEncoder(enc_layer, n_enc, norm=nn.LayerNorm(d_model))
        self.decoder = nn.TransformerDecoder(dec_layer, n_dec, norm=nn.LayerNorm(d_model))
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)

    def _emb(self, x):
        return self.embedding(x) * self.scale + self.positions[:, : x.size(1)]

    def forward(self, src, tgt_in):
        src_pad = src.eq(0)
        memory = self.encoder(self._emb(src), src_key_padding_mask=src_pad)
        L = tgt_in.size(1)
        causal = torch.ones(L, L, dtype=torch.bool, device=src.device).triu(1)
        out = self.decoder(self._emb(tgt_in), memory, tgt_mask=causal, tgt_key_padding_mask=tgt_in.eq(0),
                           memory_key_padding_mask=src_pad)
        return self.lm_head(out)

    @torch.no_grad()
    def greedy(self, src, max_len=160):
        ys = torch.ones(src.size(0), 1, dtype=torch.long, device=src.device)
        done = torch.zeros(src.size(0), dtype=torch.bool, device=src.device)
        for _ in range(max_len):
            nxt = self.forward(src, ys)[:, -1].argmax(-1)
            nxt = nxt.masked_fill(done, 0)
            ys = torch.cat([ys, nxt[:, None]], 1)
            done |= nxt.eq(2)
            if done.all():
                break
        return ys


def detok(ids, itos):
    out = []
    for i in ids[1:]:
        if i in (0, 2):
            break
        out.append(itos[i])
    return "".join(out)


def same_molecule(a, b):
    ma, mb = Chem.MolFromSmiles(a), Chem.MolFromSmiles(b)
    return ma is not None and mb is not None and Chem.MolToSmiles(ma) == Chem.MolToSmiles(mb)


@torch.no_grad()
def evaluate(raw_model, loader, pairs, itos, device):
    raw_model.eval()
    counts = torch.zeros(2, device=device)
    for src, _, idx in loader:
        out = raw_model.greedy(src.to(device)).tolist()
        for seq, i in zip(out, idx.tolist()):
            counts[0] += same_molecule(detok(seq, itos), pairs[i][1])
            counts[1] += 1
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    raw_model.train()
    return (counts[0] / counts[1]).item()


def main(args):
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    rank = dist.get_rank()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    train_pairs = read_jsonl(args.train)
    valid_pairs = read_jsonl(args.valid)
    itos, stoi = build_vocab(train_pairs + valid_pairs)

    train_ds, valid_ds = ReactionDataset(train_pairs, stoi), ReactionDataset(valid_pairs, stoi)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, collate_fn=collate,
                          num_workers=6, pin_memory=True)
    valid_dl = DataLoader(valid_ds, batch_size=128, sampler=DistributedSampler(valid_ds, shuffle=False),
                          collate_fn=collate, num_workers=2)

    net = FwdModel(len(itos)).to(dev)
    model = DistributedDataParallel(net, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)
    steps_total = args.epochs * len(train_dl)
    warm = args.warmup
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, steps_total) / steps_total)))
    criterion = nn.CrossEntropyLoss(ignore_index=0, label_smoothing=0.1)
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        print(f"vocab={len(itos)} train={len(train_ds)} valid={len(valid_ds)} steps={steps_total}", flush=True)

    best = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic, seen = time.time(), 0
        for src, tgt, _ in train_dl:
            src, tgt = src.to(dev, non_blocking=True), tgt.to(dev, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(src, tgt[:, :-1])
            loss = criterion(logits.float().flatten(0, 1), tgt[:, 1:].flatten())
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            seen += src.size(0)
        if rank == 0:
            print(f"[{epoch}] loss={loss.item():.4f} {seen / (time.time() - tic):.0f} rxn/s/gpu", flush=True)

        if (epoch + 1) % args.eval_every == 0:
            acc = evaluate(net, valid_dl, valid_pairs, itos, dev)
            if rank == 0:
                print(f"[{epoch}] valid top-1 {acc:.4f}", flush=True)
                if acc > best:
                    best = acc
                    torch.save({"model": net.state_dict(), "itos": itos, "epoch": epoch, "acc": acc},
                               os.path.join(args.out_dir, "best.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--valid", default="data/pistachio_fwd/valid.jsonl")
    p.add_argument("--out_dir", default="out/fwd")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=6000)
    p.add_argument("--eval_every", type=int, default=2)
    p.add_argument("--seed", type=int, default=17)
    main(p.parse_args())
