#!/usr/bin/env python
"""Transformer-base En->De on WMT16 (sentencepiece, joint 32k vocab).

Plain PyTorch reimplementation of the fairseq recipe: shared embeddings,
label smoothing 0.1, inverse-sqrt schedule, beam search on the dev set.
"""
import argparse
import logging
import math
import os
import time

import sacrebleu
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("wmt_ende")


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="dir with train.en/train.de/valid.en/valid.de")
    p.add_argument("--spm", required=True, help="sentencepiece model")
    p.add_argument("--save-dir", default="checkpoints/ende_base")
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=7e-4)
    p.add_argument("--warmup", type=int, default=4000)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--clip-norm", type=float, default=0.0)
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--log-interval", type=int, default=100)
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args()


class ParallelText(Dataset):
    def __init__(self, src_path, tgt_path, sp, max_len):
        self.pairs = []
        with open(src_path, encoding="utf-8") as fs, open(tgt_path, encoding="utf-8") as ft:
            for s, t in zip(fs, ft):
                s_ids = sp.encode(s.strip())[: max_len - 1] + [sp.eos_id()]
                t_ids = sp.encode(t.strip())[: max_len - 2]
                self.pairs.append((s_ids, [sp.bos_id()] + t_ids + [sp.eos_id()], t.strip()))

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        return self.pairs[i]


def make_collate(pad):
    def collate(batch):
        src_len = max(len(b[0]) for b in batch)
        tgt_len = max(len(b[1]) for b in batch)
        src = torch.full((len(batch), src_len), pad, dtype=torch.long)
        tgt = torch.full((len(batch), tgt_len), pad, dtype=torch.long)
        for i, (s, t, _) in enumerate(batch):
            src[i, : len(s)] = torch.tensor(s)
            tgt[i, : len(t)] = torch.tensor(t)
        refs = [b[2] for b in batch]
        return src, tgt, refs
    return collate


class PositionalEncoding(nn.Module):
    def __init__(self, d, max_len=1024):
        super().__init__()
        pe = torch.zeros(max_len, d)
        pos = torch.arange(max_len).unsqueeze(1).float()
        div = torch.exp(torch.arange(0, d, 2).float() * (-math.log(10000.0) / d))
        pe[:, 0::2] = torch.sin(pos * div)
        pe[:, 1::2] = torch.cos(pos * div)
        self.register_buffer("pe", pe, persistent=False)

    def forward(self, x):
        return x + self.pe[: x.size(1)].unsqueeze(0)


class Seq2SeqTransformer(nn.Module):
    def __init__(self, vocab, pad, args):
        super().__init__()
        self.pad = pad
        self.d = args.d_model
        self.embed = nn.Embedding(vocab, args.d_model, padding_idx=pad)
        nn.init.normal_(self.embed.weight, 0, args.d_model ** -0.5)
        nn.init.constant_(self.embed.weight[pad], 0)
        self.pos = PositionalEncoding(args.d_model)
        self.drop = nn.Dropout(args.dropout)
        self.transformer = nn.Transformer(
            d_model=args.d_model, nhead=args.heads,
            num_encoder_layers=args.layers, num_decoder_layers=args.layers,
            dim_feedforward=args.ffn, dropout=args.dropout, batch_first=True, norm_first=True,
        )

    def embed_tokens(self, x):
        return self.drop(self.pos(self.embed(x) * math.sqrt(self.d)))

    def encode(self, src):
        mask = src.eq(self.pad)
        return self.transformer.encoder(self.embed_tokens(src), src_key_padding_mask=mask), mask

    def decode(self, tgt_in, memory, src_mask):
        causal = self.transformer.generate_square_subsequent_mask(tgt_in.size(1)).to(tgt_in.device)
        h = self.transformer.decoder(
            self.embed_tokens(tgt_in), memory, tgt_mask=causal,
            tgt_key_padding_mask=tgt_in.eq(self.pad), memory_key_padding_mask=src_mask,
        )
        return F.linear(h, self.embed.weight)

    def forward(self, src, tgt_in):
        memory, src_mask = self.encode(src)
        return self.decode(tgt_in, memory, src_mask)


def label_smoothed_nll(logits, target, eps, pad):
    lprobs = F.log_softmax(logits.float(), dim=-1)
    target = target.unsqueeze(-1)
    nll = -lprobs.gather(dim=-1, index=target).squeeze(-1)
    smooth = -lprobs.sum(dim=-1)
    mask = target.squeeze(-1).eq(pad)
    nll = nll.masked_fill(mask, 0.0).sum()
    smooth = smooth.masked_fill(mask, 0.0).sum()
    eps_i = eps / (lprobs.size(-1) - 1)
    loss = (1.0 - eps - eps_i) * nll + eps_i * smooth
    return loss, nll


@torch.no_grad()
def beam_search(model, src, bos, eos, beam, max_len):
    """Simple batched beam search (length-normalised scores)."""
    bsz = src.size(0)
    memory, src_mask = model.encode(src)
    memory = memory.repeat_interleave(beam, 0)
    src_mask = src_mask.repeat_interleave(beam, 0)
    tokens = torch.full((bsz * beam, 1), bos, dtype=torch.long, device=src.device)
    scores = torch.zeros(bsz, beam, device=src.device)
    scores[:, 1:] = -1e9
    finished = torch.zeros(bsz * beam, dtype=torch.bool, device=src.device)
    for _ in range(max_len):
        lprobs = F.log_softmax(model.decode(tokens, memory, src_mask)[:, -1].float(), -1)
        lprobs[finished] = -1e9
        lprobs[finished, eos] = 0.0
        V = lprobs.size(-1)
        cand = (scores.view(-1, 1) + lprobs).view(bsz, beam * V)
        top, idx = cand.topk(beam, dim=-1)
        beam_idx = (idx // V) + torch.arange(bsz, device=src.device).unsqueeze(1) * beam
        tokens = torch.cat([tokens[beam_idx.view(-1)], (idx % V).view(-1, 1)], dim=1)
        finished = finished[beam_idx.view(-1)] | tokens[:, -1].eq(eos)
        scores = top
        if finished.all():
            break
    lengths = (tokens.ne(eos).cumsum(1).max(1).values + 1).float().view(bsz, beam)
    best = (scores / lengths).argmax(-1)
    out = tokens.view(bsz, beam, -1)[torch.arange(bsz), best]
    return out[:, 1:]


def validate(model, loader, sp, args, device):
    model.eval()
    hyps, refs = [], []
    for src, _, ref in loader:
        src = src.to(device, non_blocking=True)
        out = beam_search(model.module, src, sp.bos_id(), sp.eos_id(), args.beam, src.size(1) + 50)
        for row in out.tolist():
            if sp.eos_id() in row:
                row = row[: row.index(sp.eos_id())]
            hyps.append(sp.decode(row))
        refs.extend(ref)
    model.train()
    return sacrebleu.corpus_bleu(hyps, [refs]).score


def main():
    args = get_args()
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    torch.cuda.set_device(args.local_rank)
    device = torch.device("cuda", args.local_rank)
    torch.manual_seed(args.seed)

    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
    )

    sp = spm.SentencePieceProcessor(model_file=args.spm)
    pad = sp.pad_id()
    train_ds = ParallelText(os.path.join(args.data, "train.en"), os.path.join(args.data, "train.de"), sp, args.max_len)
    valid_ds = ParallelText(os.path.join(args.data, "valid.en"), os.path.join(args.data, "valid.de"), sp, args.max_len)
    collate = make_collate(pad)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=4, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid_ds, batch_size=32, shuffle=False, collate_fn=collate, num_workers=2)

    model = Seq2SeqTransformer(sp.get_piece_size(), pad, args).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    logger.info("params: %.1fM, world size %d", sum(p.numel() for p in model.parameters()) / 1e6, world_size)

    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-9)
    warmup = args.warmup
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, math.sqrt(warmup / (s + 1))))
    scaler = torch.cuda.amp.GradScaler()

    os.makedirs(args.save_dir, exist_ok=True)
    best_bleu, num_updates = 0.0, 0
    for epoch in range(1, args.epochs + 1):
        train_sampler.set_epoch(epoch)
        model.train()
        t0, tok_count, loss_acc = time.time(), 0, 0.0
        for src, tgt, _ in train_loader:
            src = src.to(device, non_blocking=True)
            tgt = tgt.to(device, non_blocking=True)
            tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]
            ntokens = tgt_out.ne(pad).sum()
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(src, tgt_in)
            loss, nll = label_smoothed_nll(logits, tgt_out, args.label_smoothing, pad)
            loss = loss / ntokens
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            if args.clip_norm > 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_norm)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            num_updates += 1
            tok_count += ntokens.item()
            loss_acc += nll.item() / ntokens.item()
            if num_updates % args.log_interval == 0:
                elapsed = time.time() - t0
                logger.info("epoch %d | upd %d | nll %.3f | ppl %.2f | lr %.2e | %.0f tok/s",
                            epoch, num_updates, loss_acc / args.log_interval,
                            2 ** (loss_acc / args.log_interval / math.log(2)),
                            scheduler.get_last_lr()[0], tok_count / elapsed)
                t0, tok_count, loss_acc = time.time(), 0, 0.0

        if rank == 0:
            bleu = validate(model, valid_loader, sp, args, device)
            logger.info("epoch %d | valid BLEU %.2f", epoch, bleu)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch, "bleu": bleu, "args": vars(args)}
            torch.save(state, os.path.join(args.save_dir, "checkpoint_last.pt"))
            if bleu > best_bleu:
                best_bleu = bleu
                torch.save(state, os.path.join(args.save_dir, "checkpoint_best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
