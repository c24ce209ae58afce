"""Abstractive summarisation on WikiHow (all.jsonl), transformer encoder-decoder from scratch.

WikiHow ships as one file, so we carve a held-out split ourselves.

    torchrun --nproc_per_node=4 10_wikihow_summarizer.py --jsonl data/wikihow/all.jsonl --spm data/wikihow/spm16k.model
"""
import argparse
import json
import math
import os
import random

import numpy as np
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from rouge_score import rouge_scorer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--jsonl", required=True)
    ap.add_argument("--spm", required=True)
    ap.add_argument("--out-dir", default="runs/wikihow")
    ap.add_argument("--valid-frac", type=float, default=0.02)
    ap.add_argument("--max-src", type=int, default=512)
    ap.add_argument("--max-tgt", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=int, default=4000)
    ap.add_argument("--beam", type=int, default=4)
    ap.add_argument("--seed", type=int, default=11)
    return ap.parse_args()


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class SummaryData(Dataset):
    def __init__(self, records, sp, max_src, max_tgt):
        self.sp, self.max_src, self.max_tgt = sp, max_src, max_tgt
        self.records = records

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        r = self.records[i]
        src = self.sp.encode(r["text"])[: self.max_src - 1] + [self.sp.eos_id()]
        tgt = self.sp.encode(r["headline"])[: self.max_tgt - 1]
        return src, [self.sp.bos_id()] + tgt, tgt + [self.sp.eos_id()], r["headline"]


def collate(batch, pad=0):
    def pad_stack(seqs):
        t = torch.full((len(seqs), max(map(len, seqs))), pad, dtype=torch.long)
        for i, s in enumerate(seqs):
            t[i, : len(s)] = torch.tensor(s)
        return t
    src, dec_in, dec_out, ref = zip(*batch)
    return pad_stack(src), pad_stack(dec_in), pad_stack(dec_out), list(ref)


class Summarizer(nn.Module):
    def __init__(self, vocab, d=512, h=8, ffn=2048, enc_layers=6, dec_layers=6, p=0.1, pad=0):
        super().__init__()
        self.pad = pad
        self.tok = nn.Embedding(vocab, d, padding_idx=pad)
        self.pos = nn.Embedding(1024, d)
        self.transformer = nn.Transformer(d, h, enc_layers, dec_layers, ffn, p, batch_first=True, norm_first=True)
        self.drop = nn.Dropout(p)
        self.d = d

    def embed(self, x):
        return self.drop(self.tok(x) * math.sqrt(self.d) + self.pos(torch.arange(x.size(1), device=x.device)))

    def encode(self, src):
        m = src.eq(self.pad)
        return self.transformer.encoder(self.embed(src), src_key_padding_mask=m), m

    def decode(self, y, mem, m):
        causal = nn.Transformer.generate_square_subsequent_mask(y.size(1), device=y.device)
        h = self.transformer.decoder(self.embed(y), mem, tgt_mask=causal,
                                     tgt_key_padding_mask=y.eq(self.pad), memory_key_padding_mask=m)
        return F.linear(h, self.tok.weight)

    def forward(self, src, dec_in):
        mem, m = self.encode(src)
        return self.decode(dec_in, mem, m)


def label_smoothed(logits, target, eps=0.1, pad=0):
    lp = F.log_softmax(logits.float(), -1)
    mask = target.ne(pad)
    nll = -lp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    smooth = -lp.mean(-1)
    return ((1 - eps) * nll + eps * smooth)[mask].sum(), nll[mask].sum(), mask.sum()


@torch.no_grad()
def beam_search(net, src, bos, eos, k=4, max_len=100, alpha=1.0):
    B = src.size(0)
    mem, m = net.encode(src)
    mem, m = mem.repeat_interleave(k, 0), m.repeat_interleave(k, 0)
    ys = torch.full((B * k, 1), bos, device=src.device, dtype=torch.long)
    scores = torch.zeros(B, k, device=src.device)
    scores[:, 1:] = -1e9
    done = torch.zeros(B * k, dtype=torch.bool, device=src.device)
    for _ in range(max_len):
        lp = F.log_softmax(net.decode(ys, mem, m)[:, -1].float(), -1)
        lp = lp.masked_fill(done.unsqueeze(1), -1e9)
        lp[done, eos] = 0
        V = lp.size(1)
        top, ix = (scores.view(-1, 1) + lp).view(B, -1).topk(k, -1)
        origin = (ix // V + torch.arange(B, device=src.device).unsqueeze(1) * k).view(-1)
        ys = torch.cat([ys[origin], (ix % V).view(-1, 1)], 1)
        done = done[origin] | ys[:, -1].eq(eos)
        scores = top
        if done.all():
            break
    lengths = (ys[:, 1:].ne(eos).sum(1) + 1).float().view(B, k)
    best = (scores / lengths ** alpha).argmax(-1)
    return ys.view(B, k, -1)[torch.arange(B), best, 1:]


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    set_seed(args.seed + rank)

    sp = spm.SentencePieceProcessor(model_file=args.spm)
    with open(args.jsonl, encoding="utf-8") as f:
        records = [json.loads(l) for l in f]
    records = [r for r in records if r.get("text") and r.get("headline")]
    random.shuffle(records)
    n_valid = int(len(records) * args.valid_frac)
    valid_records, train_records = records[:n_valid], records[n_valid:]

    train_ds = SummaryData(train_records, sp, args.max_src, args.max_tgt)
    valid_ds = SummaryData(valid_records[rank::world], sp, args.max_src, args.max_tgt)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                          num_workers=4, pin_memory=True)
    valid_dl = DataLoader(valid_ds, batch_size=32, collate_fn=collate, num_workers=2)

    net = Summarizer(sp.get_piece_size(), pad=sp.pad_id()).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.01)
    w = args.warmup
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / w, (w / (s + 1)) ** 0.5))
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        print(f"train {len(train_ds)} | valid {len(valid_records)} | world {world}", flush=True)
    best_r2, step = 0.0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for src, dec_in, dec_out, _ in train_dl:
            src, dec_in, dec_out = src.to(device), dec_in.to(device), dec_out.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(src, dec_in)
            loss, nll, ntok = label_smoothed(logits, dec_out, pad=sp.pad_id())
            opt.zero_grad(set_to_none=True)
            (loss / ntok).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if rank == 0 and step % 200 == 0:
                print(f"epoch {epoch} step {step} nll/tok {(nll / ntok).item():.3f} lr {sched.get_last_lr()[0]:.2e}",
                      flush=True)

        # ROUGE on each rank's slice of the held-out set, summed over ranks
        model.eval()
        sums = torch.zeros(4, device=device)
        for src, _, _, refs in valid_dl:
            out = beam_search(net, src.to(device), sp.bos_id(), sp.eos_id(), k=args.beam, max_len=args.max_tgt)
            for row, ref in zip(out.tolist(), refs):
                hyp = sp.decode(row[: row.index(sp.eos_id())] if sp.eos_id() in row else row)
                sc = scorer.score(ref, hyp)
                sums += torch.tensor([sc["rouge1"].fmeasure, sc["rouge2"].fmeasure,
                                      sc["rougeL"].fmeasure, 1.0], device=device)
        dist.all_reduce(sums)
        r1, r2, rl = (sums[:3] / sums[3] * 100).tolist()
        model.train()

        if rank == 0:
            print(f"epoch {epoch} | valid R1 {r1:.2f} R2 {r2:.2f} RL {rl:.2f}", flush=True)
            ckpt = {"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                    "epoch": epoch, "rouge2": r2}
            torch.save(ckpt, os.path.join(args.out_dir, "last.pt"))
            if r2 > best_r2:
                best_r2 = r2
                torch.save(ckpt, os.path.join(args.out_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
