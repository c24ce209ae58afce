#!/usr/bin/env python3
# Deep-encoder / shallow-decoder Transformer for WMT20 En-Zh.
# 18 pre-norm encoder layers with LayerDrop, 6 decoder layers, update_freq accumulation.
#
#   torchrun --nproc_per_node=8 05_deep_encoder_enzh.py --data data/enzh_spm --update-freq 2
import argparse
import contextlib
import math
import os
import random

import numpy as np
import sacrebleu
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--save-dir", default="ckpt/enzh_deep")
    p.add_argument("--enc-layers", type=int, default=18)
    p.add_argument("--dec-layers", type=int, default=6)
    p.add_argument("--encoder-layerdrop", type=float, default=0.2)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--attn-dropout", type=float, default=0.1)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--update-freq", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=8000)
    p.add_argument("--max-update", type=int, default=100000)
    p.add_argument("--save-interval-updates", type=int, default=5000)
    p.add_argument("--seed", type=int, default=7)
    return p.parse_args()


class SpmBitext(Dataset):
    def __init__(self, data, split, sp_src, sp_tgt, max_len=256):
        self.items = []
        with open(f"{data}/{split}.en") as fs, open(f"{data}/{split}.zh") as ft:
            for s, t in zip(fs, ft):
                a = sp_src.encode(s.strip(), out_type=int)[:max_len]
                b = sp_tgt.encode(t.strip(), out_type=int)[:max_len]
                if a and b:
                    self.items.append((a, b, t.strip()))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def collate(batch, pad=0, bos=1, eos=2):
    B = len(batch)
    S = max(len(x[0]) for x in batch) + 1
    T = max(len(x[1]) for x in batch) + 1
    src = torch.full((B, S), pad)
    prev = torch.full((B, T), pad)
    gold = torch.full((B, T), pad)
    for i, (a, b, _) in enumerate(batch):
        src[i, : len(a) + 1] = torch.tensor(a + [eos])
        prev[i, : len(b) + 1] = torch.tensor([bos] + b)
        gold[i, : len(b) + 1] = torch.tensor(b + [eos])
    return src, prev, gold, [x[2] for x in batch]


class PreNormEncoderLayer(nn.Module):
    def __init__(self, d, h, ffn, drop, attn_drop):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, h, dropout=attn_drop, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(d, ffn), nn.ReLU(), nn.Dropout(drop), nn.Linear(ffn, d))
        self.drop = nn.Dropout(drop)

    def forward(self, x, pad_mask):
        y = self.ln1(x)
        x = x + self.drop(self.attn(y, y, y, key_padding_mask=pad_mask, need_weights=False)[0])
        return x + self.drop(self.ff(self.ln2(x)))


class DeepEncoder(nn.Module):
    def __init__(self, args, vocab):
        super().__init__()
        self.embed = nn.Embedding(vocab, args.dim, padding_idx=0)
        self.pos = nn.Embedding(512, args.dim)
        self.layers = nn.ModuleList(
            PreNormEncoderLayer(args.dim, args.heads, args.ffn, args.dropout, args.attn_dropout)
            for _ in range(args.enc_layers))
        self.ln = nn.LayerNorm(args.dim)
        self.layerdrop = args.encoder_layerdrop
        self.drop = nn.Dropout(args.dropout)
        self.scale = math.sqrt(args.dim)

    def forward(self, src):
        mask = src.eq(0)
        pos = torch.arange(src.size(1), device=src.device)
        x = self.drop(self.embed(src) * self.scale + self.pos(pos))
        for layer in self.layers:
            if self.training and random.random() < self.layerdrop:
                continue
            x = layer(x, mask)
        return self.ln(x), mask


class Seq2Seq(nn.Module):
    def __init__(self, args, src_vocab, tgt_vocab):
        super().__init__()
        self.encoder = DeepEncoder(args, src_vocab)
        self.tgt_embed = nn.Embedding(tgt_vocab, args.dim, padding_idx=0)
        self.tgt_pos = nn.Embedding(512, args.dim)
        layer = nn.TransformerDecoderLayer(args.dim, args.heads, args.ffn, args.dropout,
                                           batch_first=True, norm_first=True)
        self.decoder = nn.TransformerDecoder(layer, args.dec_layers, norm=nn.LayerNorm(args.dim))
        self.drop = nn.Dropout(args.dropout)
        self.scale = math.sqrt(args.dim)

    def decode(self, prev, mem, mem_mask):
        T = prev.size(1)
        pos = torch.arange(T, device=prev.device)
        y = self.drop(self.tgt_embed(prev) * self.scale + self.tgt_pos(pos))
        causal = nn.Transformer.generate_square_subsequent_mask(T, device=prev.device)
        h = self.decoder(y, mem, tgt_mask=causal, tgt_key_padding_mask=prev.eq(0),
                         memory_key_padding_mask=mem_mask)
        return h @ self.tgt_embed.weight.t()

    def forward(self, src, prev):
        mem, mask = self.encoder(src)
        return self.decode(prev, mem, mask)


def smoothed_loss(logits, gold, eps=0.1):
    lprobs = logits.float().log_softmax(-1)
    valid = gold.ne(0)
    nll = -lprobs.gather(-1, gold.unsqueeze(-1)).squeeze(-1)[valid]
    smooth = -lprobs.mean(-1)[valid]
    return ((1 - eps) * nll + eps * smooth).sum(), nll.sum(), valid.sum()


@torch.no_grad()
def translate_greedy(model, src, max_len=200, bos=1, eos=2):
    mem, mask = model.encoder(src)
    ys = torch.full((src.size(0), 1), bos, device=src.device)
    for _ in range(max_len):
        nxt = model.decode(ys, mem, mask)[:, -1].argmax(-1, keepdim=True)
        ys = torch.cat([ys, nxt], 1)
        if (ys == eos).any(1).all():
            break
    out = []
    for row in ys[:, 1:].tolist():
        out.append(row[: row.index(eos)] if eos in row else row)
    return out


def save_checkpoint(path, model, opt, sched, num_updates):
    tmp = path + ".tmp"
    torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                "lr_scheduler": sched.state_dict(), "num_updates": num_updates}, tmp)
    os.replace(tmp, path)


def main():
    args = cli()
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    rank = dist.get_rank()
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    sp_en = spm.SentencePieceProcessor(model_file=f"{args.data}/spm.en.model")
    sp_zh = spm.SentencePieceProcessor(model_file=f"{args.data}/spm.zh.model")
    train = SpmBitext(args.data, "train", sp_en, sp_zh)
    valid = SpmBitext(args.data, "valid", sp_en, sp_zh)
    sampler = DistributedSampler(train, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                        num_workers=6, pin_memory=True, persistent_workers=True)

    model = Seq2Seq(args, sp_en.get_piece_size(), sp_zh.get_piece_size()).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / args.warmup, (args.warmup / (s + 1)) ** 0.5))

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
    num_updates, epoch = 0, 0
    while num_updates < args.max_update:
        epoch += 1
        sampler.set_epoch(epoch)
        model.train()
        for i, (src, prev, gold, _) in enumerate(loader):
            src, prev, gold = src.to(device), prev.to(device), gold.to(device)
            last_micro = (i + 1) % args.update_freq == 0
            ctx = model.no_sync() if not last_micro else contextlib.nullcontext()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(src, prev)
                loss, nll, ntok = smoothed_loss(logits, gold)
                (loss / ntok / args.update_freq).backward()
            if not last_micro:
                continue
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            num_updates += 1

            if rank == 0 and num_updates % 100 == 0:
                print(f"epoch {epoch} | update {num_updates} | loss {(loss / ntok).item():.4f} | "
                      f"nll {(nll / ntok).item():.4f} | gnorm {gnorm:.2f} | lr {sched.get_last_lr()[0]:.2e}",
                      flush=True)
            if num_updates % args.save_interval_updates == 0:
                if rank == 0:
                    model.eval()
                    raw = model.module
                    hyps, refs = [], []
                    for k in range(0, min(len(valid), 1000), 50):
                        src_v, _, _, ref = collate([valid[j] for j in range(k, min(k + 50, len(valid)))])
                        hyps += [sp_zh.decode(h) for h in translate_greedy(raw, src_v.to(device))]
                        refs += ref
                    bleu = sacrebleu.corpus_bleu(hyps, [refs], tokenize="zh").score
                    print(f"| update {num_updates} | valid BLEU (greedy, 1k) {bleu:.2f}", flush=True)
                    save_checkpoint(os.path.join(args.save_dir, f"checkpoint_{epoch}_{num_updates}.pt"),
                                    model, opt, sched, num_updates)
                    model.train()
                dist.barrier()
            if num_updates >= args.max_update:
                break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
