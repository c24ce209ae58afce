"""IWSLT'14 De->En, transformer_iwslt_de_en sized model, hand-written trainer.

Input: BPE'd text (learn_bpe/apply_bpe from the fairseq prepare-iwslt14.sh)
    $DATA/{train,valid,test}.{de,en}

The first run binarizes the corpus into $DATA/cache/*.pt; later runs load it.

    torchrun --nproc_per_node=4 03_iwslt14_deen.py --data data/iwslt14.tokenized.de-en
"""
import argparse
import math
import os
import random
from collections import Counter

import numpy as np
import sacrebleu
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

PAD, BOS, EOS, UNK = 0, 1, 2, 3
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]


class Dictionary:
    def __init__(self, symbols):
        self.symbols = list(symbols)
        self.index = {s: i for i, s in enumerate(self.symbols)}

    @classmethod
    def build(cls, path, threshold=0):
        cnt = Counter()
        with open(path, encoding="utf-8") as f:
            for line in f:
                cnt.update(line.split())
        words = [w for w, c in sorted(cnt.items(), key=lambda x: (-x[1], x[0])) if c > threshold]
        return cls(SPECIALS + words)

    def encode(self, line):
        return [self.index.get(w, UNK) for w in line.split()] + [EOS]

    def string(self, ids):
        toks = [self.symbols[i] for i in ids if i not in (PAD, BOS, EOS)]
        return " ".join(toks).replace("@@ ", "").replace("@@", "")

    def __len__(self):
        return len(self.symbols)


def binarize(data_dir, src, tgt):
    src_dict = Dictionary.build(os.path.join(data_dir, f"train.{src}"))
    tgt_dict = Dictionary.build(os.path.join(data_dir, f"train.{tgt}"))
    out = {"src_dict": src_dict.symbols, "tgt_dict": tgt_dict.symbols}
    for split in ("train", "valid", "test"):
        with open(os.path.join(data_dir, f"{split}.{src}"), encoding="utf-8") as fs, \
                open(os.path.join(data_dir, f"{split}.{tgt}"), encoding="utf-8") as ft:
            pairs = [(src_dict.encode(s), tgt_dict.encode(t), t.strip()) for s, t in zip(fs, ft)]
        out[split] = pairs
    return out


def load_dataset(data_dir, src, tgt):
    cache_dir = os.path.join(data_dir, "cache")
    cache = os.path.join(cache_dir, f"{src}-{tgt}.pt")
    if os.path.exists(cache):
        return torch.load(cache)
    os.makedirs(cache_dir, exist_ok=True)
    data = binarize(data_dir, src, tgt)
    torch.save(data, cache)
    return data


def batch_by_size(pairs, max_tokens, max_positions=1024):
    """Length-sorted token-budget batches, like fairseq's batch_by_size."""
    order = sorted(range(len(pairs)), key=lambda i: (len(pairs[i][0]), len(pairs[i][1])))
    batches, cur, cur_max = [], [], 0
    for i in order:
        n = max(len(pairs[i][0]), len(pairs[i][1]))
        if n > max_positions:
            continue
        new_max = max(cur_max, n)
        if cur and new_max * (len(cur) + 1) > max_tokens:
            batches.append(cur)
            cur, cur_max = [], 0
            new_max = n
        cur.append(i)
        cur_max = new_max
    if cur:
        batches.append(cur)
    return batches


def shard_batches(batches, rank, world_size, epoch, seed):
    rng = np.random.RandomState(seed + epoch)
    batches = [batches[i] for i in rng.permutation(len(batches))]
    # pad so that every rank sees the same number of batches
    rem = len(batches) % world_size
    if rem:
        batches = batches + batches[: world_size - rem]
    return batches[rank::world_size]


def collate(pairs, idxs, device):
    s = [pairs[i][0] for i in idxs]
    t = [pairs[i][1] for i in idxs]
    src = torch.full((len(s), max(map(len, s))), PAD, dtype=torch.long)
    prev = torch.full((len(t), max(map(len, t))), PAD, dtype=torch.long)
    tgt = torch.full_like(prev, PAD)
    for k, (a, b) in enumerate(zip(s, t)):
        src[k, : len(a)] = torch.tensor(a)
        tgt[k, : len(b)] = torch.tensor(b)
        prev[k, 0] = BOS
        prev[k, 1: len(b)] = torch.tensor(b[:-1])
    return src.to(device, non_blocking=True), prev.to(device, non_blocking=True), tgt.to(device, non_blocking=True)


class TransformerNMT(nn.Module):
    def __init__(self, src_vocab, tgt_vocab, d=512, ffn=1024, heads=4, layers=6, dropout=0.3):
        super().__init__()
        self.d = d
        self.src_embed = nn.Embedding(src_vocab, d, padding_idx=PAD)
        self.tgt_embed = nn.Embedding(tgt_vocab, d, padding_idx=PAD)
        for e in (self.src_embed, self.tgt_embed):
            nn.init.normal_(e.weight, 0, d ** -0.5)
            nn.init.zeros_(e.weight[PAD])
        self.pos = nn.Embedding(1026, d)
        self.drop = nn.Dropout(dropout)
        enc = nn.TransformerEncoderLayer(d, heads, ffn, dropout, batch_first=True)
        dec = nn.TransformerDecoderLayer(d, heads, ffn, dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(enc, layers)
        self.decoder = nn.TransformerDecoder(dec, layers)

    def _emb(self, table, x):
        pos = torch.arange(x.size(1), device=x.device).unsqueeze(0)
        return self.drop(table(x) * math.sqrt(self.d) + self.pos(pos))

    def forward(self, src, prev):
        smask = src.eq(PAD)
        mem = self.encoder(self._emb(self.src_embed, src), src_key_padding_mask=smask)
        causal = torch.triu(torch.full((prev.size(1), prev.size(1)), float("-inf"), device=src.device), 1)
        h = self.decoder(self._emb(self.tgt_embed, prev), mem, tgt_mask=causal,
                         tgt_key_padding_mask=prev.eq(PAD), memory_key_padding_mask=smask)
        return F.linear(h, self.tgt_embed.weight)


def ls_loss(logits, target, eps):
    lprobs = F.log_softmax(logits, -1, dtype=torch.float32)
    nll = -lprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    smooth = -lprobs.sum(-1)
    pad = target.eq(PAD)
    nll, smooth = nll.masked_fill(pad, 0).sum(), smooth.masked_fill(pad, 0).sum()
    eps_i = eps / (lprobs.size(-1) - 1)
    return (1 - eps - eps_i) * nll + eps_i * smooth, nll


@torch.no_grad()
def greedy(model, src, max_len):
    ys = torch.full((src.size(0), 1), BOS, dtype=torch.long, device=src.device)
    done = torch.zeros(src.size(0), dtype=torch.bool, device=src.device)
    for _ in range(max_len):
        nxt = model(src, ys)[:, -1].argmax(-1)
        nxt = nxt.masked_fill(done, PAD)
        ys = torch.cat([ys, nxt.unsqueeze(1)], 1)
        done |= nxt.eq(EOS)
        if done.all():
            break
    return ys[:, 1:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--src", default="de")
    ap.add_argument("--tgt", default="en")
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=int, default=4000)
    ap.add_argument("--max-epoch", type=int, default=60)
    ap.add_argument("--save-dir", default="checkpoints/iwslt14")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    data = load_dataset(args.data, args.src, args.tgt)
    src_dict, tgt_dict = Dictionary(data["src_dict"]), Dictionary(data["tgt_dict"])
    train, valid = data["train"], data["valid"]
    train_batches = batch_by_size(train, args.max_tokens)
    valid_batches = batch_by_size(valid, args.max_tokens)
    if rank == 0:
        print(f"| {len(src_dict)} src / {len(tgt_dict)} tgt types, {len(train)} train pairs, "
              f"{len(train_batches)} batches, world {world}", flush=True)

    model = DDP(TransformerNMT(len(src_dict), len(tgt_dict)).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-8, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / args.warmup if s < args.warmup else math.sqrt(args.warmup / (s + 1)))

    os.makedirs(args.save_dir, exist_ok=True)
    best = float("inf")
    for epoch in range(1, args.max_epoch + 1):
        model.train()
        for step, idxs in enumerate(shard_batches(train_batches, rank, world, epoch, args.seed)):
            src, prev, tgt = collate(train, idxs, device)
            loss, nll = ls_loss(model(src, prev), tgt, 0.1)
            ntok = tgt.ne(PAD).sum()
            opt.zero_grad(set_to_none=True)
            (loss / ntok).backward()
            opt.step()
            sched.step()
            if rank == 0 and step % 200 == 0:
                print(f"| epoch {epoch:03d} | step {step} | loss {(loss / ntok).item() / math.log(2):.3f} "
                      f"| lr {sched.get_last_lr()[0]:.2e}", flush=True)

        # validation loss over all ranks
        model.eval()
        stats = torch.zeros(2, device=device)
        with torch.no_grad():
            for idxs in valid_batches[rank::world]:
                src, prev, tgt = collate(valid, idxs, device)
                _, nll = ls_loss(model.module(src, prev), tgt, 0.1)
                stats += torch.stack([nll, tgt.ne(PAD).sum().float()])
        dist.all_reduce(stats)
        valid_nll = (stats[0] / stats[1]).item() / math.log(2)

        if rank == 0:
            hyps, refs = [], []
            for idxs in valid_batches[:20]:
                src, _, _ = collate(valid, idxs, device)
                for k, row in zip(idxs, greedy(model.module, src, src.size(1) + 20).tolist()):
                    hyps.append(tgt_dict.string(row[: row.index(EOS)] if EOS in row else row))
                    refs.append(valid[k][2].replace("@@ ", ""))
            bleu = sacrebleu.corpus_bleu(hyps, [refs], tokenize="none").score
            print(f"| epoch {epoch:03d} | valid nll {valid_nll:.3f} | valid ppl {2 ** valid_nll:.2f} "
                  f"| bleu(subset) {bleu:.2f}", flush=True)
            ckpt = {"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                    "epoch": epoch, "valid_nll": valid_nll}
            torch.save(ckpt, os.path.join(args.save_dir, "checkpoint_last.pt"))
            if valid_nll < best:
                best = valid_nll
                torch.save(ckpt, os.path.join(args.save_dir, "checkpoint_best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
