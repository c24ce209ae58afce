#!/usr/bin/env python
"""WMT17 Fi->En transformer-base; validation BLEU from summed n-gram statistics.

Each worker translates its part of newsdev2017 and the n-gram match counts are
summed across workers before BLEU is computed, the same way fairseq's
translation task aggregates `_bleu_counts` / `_bleu_totals`.

    torchrun --nproc_per_node=8 13_wmt17_fien_bleu_stats.py --data data/wmt17_fien --max-tokens 4096
"""
import argparse
import math
import os
import time

import numpy as np
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sacrebleu.metrics import BLEU
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler


class TextPairs(Dataset):
    def __init__(self, prefix, sp, max_len=250):
        with open(prefix + ".fi") as f:
            fi = f.read().splitlines()
        with open(prefix + ".en") as f:
            en = f.read().splitlines()
        self.src = [sp.encode(x)[:max_len] for x in fi]
        self.tgt = [sp.encode(x)[:max_len] for x in en]
        self.ref = en
        self.sizes = np.array([max(len(a), len(b)) for a, b in zip(self.src, self.tgt)])

    def __len__(self):
        return len(self.src)

    def __getitem__(self, i):
        return self.src[i], self.tgt[i], self.ref[i]


class ShardedTokenBatches(Sampler):
    def __init__(self, sizes, max_tokens, rank, world, shuffle=True, seed=0):
        order = np.argsort(sizes, kind="mergesort")
        self.batches, cur, longest = [], [], 0
        for i in order:
            n = int(sizes[i]) + 1
            if cur and max(longest, n) * (len(cur) + 1) > max_tokens:
                self.batches.append(cur)
                cur, longest = [], 0
            cur.append(int(i))
            longest = max(longest, n)
        if cur:
            self.batches.append(cur)
        self.rank, self.world, self.shuffle, self.seed, self.epoch = rank, world, shuffle, seed, 0
        self.per_rank = math.ceil(len(self.batches) / world)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        ids = list(range(len(self.batches)))
        if self.shuffle:
            ids = np.random.RandomState(self.seed + self.epoch).permutation(len(self.batches)).tolist()
        ids += ids[: self.per_rank * self.world - len(ids)]
        return iter([self.batches[j] for j in ids[self.rank::self.world]])

    def __len__(self):
        return self.per_rank


def make_collate(pad, bos, eos):
    def collate(items):
        src = [s + [eos] for s, _, _ in items]
        tgt = [t + [eos] for _, t, _ in items]
        S, T = max(map(len, src)), max(map(len, tgt))
        x = torch.full((len(items), S), pad)
        y = torch.full((len(items), T), pad)
        yin = torch.full((len(items), T), pad)
        for i, (a, b) in enumerate(zip(src, tgt)):
            x[i, : len(a)] = torch.tensor(a)
            y[i, : len(b)] = torch.tensor(b)
            yin[i, : len(b)] = torch.tensor([bos] + b[:-1])
        return x, yin, y, [r for _, _, r in items]
    return collate


class Transformer(nn.Module):
    def __init__(self, vocab, pad, d=512, h=8, ffn=2048, layers=6, p=0.1):
        super().__init__()
        self.pad = pad
        self.emb = nn.Embedding(vocab, d, padding_idx=pad)
        self.pos = nn.Embedding(512, d)
        self.t = nn.Transformer(d, h, layers, layers, ffn, p, batch_first=True)
        self.drop = nn.Dropout(p)
        self.scale = math.sqrt(d)

    def embed(self, x):
        return self.drop(self.emb(x) * self.scale + self.pos(torch.arange(x.size(1), device=x.device)))

    def encode(self, x):
        return self.t.encoder(self.embed(x), src_key_padding_mask=x.eq(self.pad))

    def decode(self, yin, mem, x):
        causal = self.t.generate_square_subsequent_mask(yin.size(1), device=yin.device)
        h = self.t.decoder(self.embed(yin), mem, tgt_mask=causal, tgt_key_padding_mask=yin.eq(self.pad),
                           memory_key_padding_mask=x.eq(self.pad))
        return F.linear(h, self.emb.weight)

    def forward(self, x, yin):
        return self.decode(yin, self.encode(x), x)


def ls_ce(logits, y, eps, pad):
    lp = logits.float().log_softmax(-1)
    nll = -lp.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    smooth = -lp.sum(-1)
    m = y.ne(pad)
    eps_i = eps / (lp.size(-1) - 1)
    return ((1 - eps - eps_i) * nll + eps_i * smooth)[m].sum(), nll[m].sum(), m.sum()


@torch.no_grad()
def beam(net, x, bos, eos, k, max_len):
    B = x.size(0)
    mem = net.encode(x).repeat_interleave(k, 0)
    xk = x.repeat_interleave(k, 0)
    ys = torch.full((B * k, 1), bos, device=x.device)
    sc = torch.zeros(B, k, device=x.device)
    sc[:, 1:] = -1e9
    fin = torch.zeros(B * k, dtype=torch.bool, device=x.device)
    for _ in range(max_len):
        lp = net.decode(ys, mem, xk)[:, -1].float().log_softmax(-1)
        lp[fin] = -1e9
        lp[fin, eos] = 0
        V = lp.size(-1)
        top, ix = (sc.view(-1, 1) + lp).view(B, -1).topk(k, 1)
        base = (ix // V + torch.arange(B, device=x.device)[:, None] * k).view(-1)
        ys = torch.cat([ys[base], (ix % V).view(-1, 1)], 1)
        fin = fin[base] | ys[:, -1].eq(eos)
        sc = top
        if fin.all():
            break
    L = (ys[:, 1:].ne(eos).sum(1) + 1).float().view(B, k)
    return ys.view(B, k, -1)[torch.arange(B), (sc / L).argmax(1), 1:].tolist()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--save-dir", default="checkpoints/fien")
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=7e-4)
    ap.add_argument("--warmup", type=int, default=4000)
    ap.add_argument("--max-epoch", type=int, default=40)
    ap.add_argument("--beam", type=int, default=4)
    ap.add_argument("--label-smoothing", type=float, default=0.1)
    args = ap.parse_args()

    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(1)

    sp = spm.SentencePieceProcessor(model_file=os.path.join(args.data, "spm.model"))
    pad, bos, eos = sp.pad_id(), sp.bos_id(), sp.eos_id()
    train = TextPairs(os.path.join(args.data, "train"), sp)
    valid = TextPairs(os.path.join(args.data, "newsdev2017"), sp)
    collate = make_collate(pad, bos, eos)
    train_bs = ShardedTokenBatches(train.sizes, args.max_tokens, rank, world, shuffle=True)
    train_dl = DataLoader(train, batch_sampler=train_bs, collate_fn=collate, num_workers=4, pin_memory=True)
    # no padding for validation: each sentence is decoded exactly once
    valid_idx = list(range(rank, len(valid), world))
    valid_dl = DataLoader(torch.utils.data.Subset(valid, valid_idx), batch_size=48, collate_fn=collate)

    net = Transformer(sp.get_piece_size(), pad).to(dev)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-8)
    W = args.warmup
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / W, (W / (s + 1)) ** 0.5))
    bleu_metric = BLEU()
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)

    best = -1.0
    for epoch in range(1, args.max_epoch + 1):
        train_bs.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, (x, yin, y, _) in enumerate(train_dl):
            x, yin, y = x.to(dev), yin.to(dev), y.to(dev)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x, yin)
            loss, nll, ntok = ls_ce(logits, y, args.label_smoothing, pad)
            opt.zero_grad(set_to_none=True)
            (loss / ntok).backward()
            opt.step()
            sched.step()
            if rank == 0 and step % 200 == 0:
                print(f"epoch {epoch} step {step}/{len(train_bs)} nll {(nll / ntok).item():.3f} "
                      f"lr {sched.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)

        net.eval()
        hyps, refs = [], []
        vloss = torch.zeros(2, device=dev)
        with torch.no_grad():
            for x, yin, y, ref in valid_dl:
                x, yin, y = x.to(dev), yin.to(dev), y.to(dev)
                _, nll, ntok = ls_ce(net(x, yin), y, args.label_smoothing, pad)
                vloss += torch.stack([nll, ntok.float()])
                for row in beam(net, x, bos, eos, args.beam, x.size(1) + 20):
                    hyps.append(sp.decode(row[: row.index(eos)] if eos in row else row))
                refs.extend(ref)
        net.train()
        dist.all_reduce(vloss)

        s = bleu_metric.corpus_score(hyps, [refs])
        stats = torch.tensor(s.counts + s.totals + [s.sys_len, s.ref_len], dtype=torch.float64)
        dist.all_reduce(stats)
        stats = stats.long().tolist()
        bleu = BLEU.compute_bleu(stats[0:4], stats[4:8], stats[8], stats[9]).score

        if rank == 0:
            vl = (vloss[0] / vloss[1]).item()
            print(f"| epoch {epoch} | valid nll {vl:.3f} | ppl {math.exp(vl):.2f} | BLEU {bleu:.2f}", flush=True)
            ckpt = {"model": net.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch, "bleu": bleu}
            torch.save(ckpt, os.path.join(args.save_dir, "checkpoint_last.pt"))
            if bleu > best:
                best = bleu
                torch.save(ckpt, os.path.join(args.save_dir, "checkpoint_best.pt"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
