#!/usr/bin/env python
"""Transformer-base NMT (WMT16 En-De) trained from scratch with token-based batching.

    torchrun --nproc_per_node=8 01_nmt_transformer_tokbatch.py \
        --data data/wmt16_en_de --spm data/wmt16_en_de/spm.model --fp16
"""
import argparse
import math
import os
import random
import time

import sacrebleu
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--spm", required=True)
    p.add_argument("--src", default="en")
    p.add_argument("--tgt", default="de")
    p.add_argument("--max-tokens", type=int, default=4096, help="tokens per batch per GPU")
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=7e-4)
    p.add_argument("--warmup", type=int, default=4000)
    p.add_argument("--max-epochs", type=int, default=30)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--clip-norm", type=float, default=0.0)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--save-dir", default="checkpoints/transformer_wmt16")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--log-interval", type=int, default=100)
    return p.parse_args()


class SinusoidalPositions(nn.Module):
    def __init__(self, d_model, max_len=1024):
        super().__init__()
        pe = torch.zeros(max_len, d_model)
        pos = torch.arange(max_len).unsqueeze(1).float()
        div = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(pos * div)
        pe[:, 1::2] = torch.cos(pos * div)
        self.register_buffer("pe", pe, persistent=False)

    def forward(self, x):
        return x + self.pe[: x.size(1)].unsqueeze(0)


class TransformerNMT(nn.Module):
    def __init__(self, vocab_size, pad_id, args):
        super().__init__()
        self.pad_id = pad_id
        self.d_model = args.d_model
        self.embed = nn.Embedding(vocab_size, args.d_model, padding_idx=pad_id)
        nn.init.normal_(self.embed.weight, mean=0.0, std=args.d_model ** -0.5)
        with torch.no_grad():
            self.embed.weight[pad_id].zero_()
        self.pos = SinusoidalPositions(args.d_model)
        self.drop = nn.Dropout(args.dropout)
        self.transformer = nn.Transformer(
            d_model=args.d_model, nhead=args.heads,
            num_encoder_layers=args.layers, num_decoder_layers=args.layers,
            dim_feedforward=args.ffn, dropout=args.dropout,
            batch_first=True, norm_first=True,
        )

    def _embed(self, tokens):
        return self.drop(self.pos(self.embed(tokens) * math.sqrt(self.d_model)))

    def encode(self, src):
        src_pad = src.eq(self.pad_id)
        return self.transformer.encoder(self._embed(src), src_key_padding_mask=src_pad), src_pad

    def decode(self, prev, memory, src_pad):
        T = prev.size(1)
        causal = torch.ones(T, T, dtype=torch.bool, device=prev.device).triu(1)
        h = self.transformer.decoder(
            self._embed(prev), memory, tgt_mask=causal,
            tgt_key_padding_mask=prev.eq(self.pad_id), memory_key_padding_mask=src_pad,
        )
        return F.linear(h, self.embed.weight)  # tied output projection

    def forward(self, src, prev):
        memory, src_pad = self.encode(src)
        return self.decode(prev, memory, src_pad)


def load_split(args, split, sp):
    with open(os.path.join(args.data, f"{split}.{args.src}")) as fs, \
            open(os.path.join(args.data, f"{split}.{args.tgt}")) as ft:
        src_lines = [l.rstrip("\n") for l in fs]
        tgt_lines = [l.rstrip("\n") for l in ft]
    assert len(src_lines) == len(tgt_lines), split
    src_ids, tgt_ids = sp.encode(src_lines), sp.encode(tgt_lines)
    pairs = []
    for s, t, ref in zip(src_ids, tgt_ids, tgt_lines):
        if 0 < len(s) <= args.max_len and 0 < len(t) <= args.max_len:
            pairs.append((s + [sp.eos_id()], [sp.bos_id()] + t + [sp.eos_id()], ref))
    return pairs


def batch_by_tokens(pairs, max_tokens):
    """Sort by length and pack into batches of at most max_tokens padded tokens."""
    order = sorted(range(len(pairs)), key=lambda i: (len(pairs[i][0]), len(pairs[i][1])))
    batches, cur, cur_max = [], [], 0
    for i in order:
        n = max(len(pairs[i][0]), len(pairs[i][1]))
        if cur and max(cur_max, n) * (len(cur) + 1) > max_tokens:
            batches.append(cur)
            cur, cur_max = [], 0
        cur.append(i)
        cur_max = max(cur_max, n)
    if cur:
        batches.append(cur)
    return batches


def collate(pairs, idx, pad_id, device):
    src = nn.utils.rnn.pad_sequence([torch.tensor(pairs[i][0]) for i in idx], batch_first=True, padding_value=pad_id)
    tgt = nn.utils.rnn.pad_sequence([torch.tensor(pairs[i][1]) for i in idx], batch_first=True, padding_value=pad_id)
    return src.to(device, non_blocking=True), tgt.to(device, non_blocking=True)


def label_smoothed_nll(logits, target, eps, pad_id):
    lprobs = F.log_softmax(logits.float(), dim=-1)
    mask = target.ne(pad_id)
    nll = -lprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1)[mask].sum()
    smooth = -lprobs.sum(-1)[mask].sum()
    loss = (1.0 - eps) * nll + (eps / lprobs.size(-1)) * smooth
    return loss, nll


def inverse_sqrt(warmup):
    def fn(step):
        step = max(step, 1)
        return min(step / warmup, (warmup / step) ** 0.5)
    return fn


@torch.no_grad()
def greedy_decode(model, src, sp, max_len=200):
    memory, src_pad = model.encode(src)
    ys = torch.full((src.size(0), 1), sp.bos_id(), dtype=torch.long, device=src.device)
    done = torch.zeros(src.size(0), dtype=torch.bool, device=src.device)
    for _ in range(max_len):
        logits = model.decode(ys, memory, src_pad)[:, -1]
        nxt = logits.argmax(-1).masked_fill(done, model.pad_id)
        ys = torch.cat([ys, nxt.unsqueeze(1)], dim=1)
        done |= nxt.eq(sp.eos_id())
        if done.all():
            break
    return ys[:, 1:].tolist()


@torch.no_grad()
def validate(model, valid_pairs, valid_batches, sp, pad_id, device, rank, world_size, args):
    model.eval()
    stats = torch.zeros(2, device=device)  # nll sum, target tokens
    hyps = []
    for idx in valid_batches[rank::world_size]:
        src, tgt = collate(valid_pairs, idx, pad_id, device)
        with torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16):
            logits = model(src, tgt[:, :-1])
        _, nll = label_smoothed_nll(logits, tgt[:, 1:], 0.0, pad_id)
        stats[0] += nll
        stats[1] += tgt[:, 1:].ne(pad_id).sum()
        with torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16):
            out = greedy_decode(model, src, sp)
        for i, toks in zip(idx, out):
            toks = [t for t in toks if t not in (pad_id, sp.eos_id())]
            hyps.append((i, sp.decode(toks)))
    dist.all_reduce(stats)
    gathered = [None] * world_size
    dist.all_gather_object(gathered, hyps)
    bleu = None
    if rank == 0:
        merged = dict(h for part in gathered for h in part)
        order = sorted(merged)
        bleu = sacrebleu.corpus_bleu([merged[i] for i in order], [[valid_pairs[i][2] for i in order]]).score
    model.train()
    return (stats[0] / stats[1]).item() / math.log(2), bleu


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    sp = spm.SentencePieceProcessor(model_file=args.spm)
    pad_id = sp.pad_id()
    train_pairs = load_split(args, "train", sp)
    valid_pairs = load_split(args, "valid", sp)
    train_batches = batch_by_tokens(train_pairs, args.max_tokens)
    valid_batches = batch_by_tokens(valid_pairs, args.max_tokens)
    if rank == 0:
        print(f"| train {len(train_pairs)} pairs, {len(train_batches)} batches; valid {len(valid_pairs)} pairs")

    model = TransformerNMT(sp.get_piece_size(), pad_id, args).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, inverse_sqrt(args.warmup))
    scaler = torch.cuda.amp.GradScaler(enabled=args.fp16)

    start_epoch, num_updates, best_bleu = 1, 0, -1.0
    last_ckpt = os.path.join(args.save_dir, "checkpoint_last.pt")
    if os.path.exists(last_ckpt):
        state = torch.load(last_ckpt, map_location="cpu")
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        start_epoch, num_updates, best_bleu = state["epoch"] + 1, state["num_updates"], state["best_bleu"]
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)

    for epoch in range(start_epoch, args.max_epochs + 1):
        model.train()
        epoch_batches = list(train_batches)
        random.Random(args.seed + epoch).shuffle(epoch_batches)
        my_batches = epoch_batches[rank::world_size]
        log = torch.zeros(3, device=device)  # loss, nll, tokens
        t0 = time.time()
        for i, idx in enumerate(my_batches):
            src, tgt = collate(train_pairs, idx, pad_id, device)
            prev, target = tgt[:, :-1], tgt[:, 1:]
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16):
                logits = model(src, prev)
            loss, nll = label_smoothed_nll(logits, target, args.label_smoothing, pad_id)
            ntok = target.ne(pad_id).sum()
            scaler.scale(loss / ntok).backward()
            if args.clip_norm > 0:
                scaler.unscale_(optimizer)
                nn.utils.clip_grad_norm_(model.parameters(), args.clip_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            num_updates += 1
            log += torch.stack([loss.detach(), nll.detach(), ntok.float()])

            if num_updates % args.log_interval == 0:
                dist.all_reduce(log)
                if rank == 0:
                    print(f"| epoch {epoch:03d} | {i + 1}/{len(my_batches)} | loss {log[0] / log[2] / math.log(2):.3f} "
                          f"| nll {log[1] / log[2] / math.log(2):.3f} | lr {scheduler.get_last_lr()[0]:.2e} "
                          f"| wps {log[2].item() / (time.time() - t0):.0f} | upd {num_updates}", flush=True)
                log.zero_()
                t0 = time.time()

        valid_nll, bleu = validate(model.module, valid_pairs, valid_batches, sp, pad_id, device, rank, world_size, args)
        if rank == 0:
            print(f"| epoch {epoch:03d} | valid nll {valid_nll:.3f} | ppl {2 ** valid_nll:.2f} | bleu {bleu:.2f}", flush=True)
            state = {
                "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict(),
                "epoch": epoch,
                "num_updates": num_updates,
                "best_bleu": max(best_bleu, bleu),
                "args": vars(args),
            }
            torch.save(state, os.path.join(args.save_dir, f"checkpoint{epoch}.pt"))
            torch.save(state, last_ckpt)
            if bleu > best_bleu:
                best_bleu = bleu
                torch.save(state, os.path.join(args.save_dir, "checkpoint_best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
