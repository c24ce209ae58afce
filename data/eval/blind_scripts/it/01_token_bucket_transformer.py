#!/usr/bin/env python
"""Train a Transformer-base NMT model (pre-norm) on SentencePiece-encoded parallel data.

Batches are packed by token count, fairseq style, so every update sees roughly the
same number of target tokens no matter how long the sentences are.

    torchrun --nproc_per_node=8 01_token_bucket_transformer.py \
        --data-dir data/wmt14_en_de --spm-model data/spm/ende.model
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
from torch.utils.data import DataLoader, Dataset
from torch.utils.tensorboard import SummaryWriter

PAD, BOS, EOS, UNK = 0, 1, 2, 3


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", required=True)
    p.add_argument("--src", default="en")
    p.add_argument("--tgt", default="de")
    p.add_argument("--spm-model", required=True)
    p.add_argument("--save-dir", default="checkpoints/transformer_base_ende")
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=7e-4)
    p.add_argument("--warmup", type=int, default=4000)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--log-every", type=int, default=100)
    return p.parse_args()


def read_parallel(prefix, src, tgt, sp, max_len):
    pairs = []
    with open(f"{prefix}.{src}", encoding="utf-8") as fs, open(f"{prefix}.{tgt}", encoding="utf-8") as ft:
        for s, t in zip(fs, ft):
            s_ids = sp.encode(s.strip())[: max_len - 1] + [EOS]
            t_ids = [BOS] + sp.encode(t.strip())[: max_len - 2] + [EOS]
            pairs.append((s_ids, t_ids))
    return pairs


class ParallelDataset(Dataset):
    def __init__(self, pairs):
        self.pairs = pairs

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        return self.pairs[i]


class ShardedTokenBatchSampler:
    """Packs this rank's shard of the corpus into batches of at most max_tokens."""

    def __init__(self, lengths, max_tokens, rank, world_size, seed=0):
        self.lengths = lengths
        self.max_tokens = max_tokens
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _batches(self):
        g = random.Random(self.seed + self.epoch)
        indices = list(range(len(self.lengths)))
        g.shuffle(indices)
        shard = indices[self.rank :: self.world_size]
        shard.sort(key=lambda i: self.lengths[i])
        batches, cur, cur_max = [], [], 0
        for i in shard:
            n = self.lengths[i]
            if cur and max(cur_max, n) * (len(cur) + 1) > self.max_tokens:
                batches.append(cur)
                cur, cur_max = [], 0
            cur.append(i)
            cur_max = max(cur_max, n)
        if cur:
            batches.append(cur)
        g.shuffle(batches)
        return batches

    def __iter__(self):
        return iter(self._batches())

    def __len__(self):
        return len(self._batches())


def collate(batch):
    src_len = max(len(s) for s, _ in batch)
    tgt_len = max(len(t) for _, t in batch)
    src = torch.full((len(batch), src_len), PAD, dtype=torch.long)
    tgt = torch.full((len(batch), tgt_len), PAD, dtype=torch.long)
    for i, (s, t) in enumerate(batch):
        src[i, : len(s)] = torch.tensor(s)
        tgt[i, : len(t)] = torch.tensor(t)
    return src, tgt


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, max_len=1024):
        super().__init__()
        pe = torch.zeros(max_len, d_model)
        pos = torch.arange(max_len).unsqueeze(1)
        div = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(pos * div)
        pe[:, 1::2] = torch.cos(pos * div)
        self.register_buffer("pe", pe, persistent=False)

    def forward(self, x):
        return x + self.pe[: x.size(1)]


class Seq2SeqTransformer(nn.Module):
    def __init__(self, vocab, d_model, layers, heads=8, ff=2048, dropout=0.1):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model, padding_idx=PAD)
        self.pos = PositionalEncoding(d_model)
        self.transformer = nn.Transformer(d_model, heads, layers, layers, ff, dropout,
                                          batch_first=True, norm_first=True)
        self.out = nn.Linear(d_model, vocab, bias=False)
        self.out.weight = self.embed.weight
        self.scale = math.sqrt(d_model)

    def encode(self, src):
        mask = src.eq(PAD)
        x = self.pos(self.embed(src) * self.scale)
        return self.transformer.encoder(x, src_key_padding_mask=mask), mask

    def decode(self, tgt_in, memory, src_mask):
        T = tgt_in.size(1)
        causal = torch.triu(torch.full((T, T), float("-inf"), device=tgt_in.device), 1)
        y = self.pos(self.embed(tgt_in) * self.scale)
        h = self.transformer.decoder(y, memory, tgt_mask=causal,
                                     tgt_key_padding_mask=tgt_in.eq(PAD),
                                     memory_key_padding_mask=src_mask)
        return self.out(h)

    def forward(self, src, tgt_in):
        memory, src_mask = self.encode(src)
        return self.decode(tgt_in, memory, src_mask)


@torch.no_grad()
def greedy_decode(model, src, max_len=200):
    memory, src_mask = model.encode(src)
    ys = torch.full((src.size(0), 1), BOS, dtype=torch.long, device=src.device)
    done = torch.zeros(src.size(0), dtype=torch.bool, device=src.device)
    for _ in range(max_len):
        nxt = model.decode(ys, memory, src_mask)[:, -1].argmax(-1)
        nxt = nxt.masked_fill(done, PAD)
        ys = torch.cat([ys, nxt.unsqueeze(1)], 1)
        done |= nxt.eq(EOS)
        if done.all():
            break
    return ys[:, 1:]


def strip_ids(ids):
    out = []
    for t in ids:
        if t in (EOS, PAD):
            break
        out.append(t)
    return out


def evaluate_bleu(model, valid_pairs, sp, refs, rank, world_size, device, bsz=64):
    model.eval()
    my_idx = list(range(rank, len(valid_pairs), world_size))
    results = []
    for b in range(0, len(my_idx), bsz):
        idx = my_idx[b : b + bsz]
        src, _ = collate([valid_pairs[i] for i in idx])
        hyp = greedy_decode(model, src.to(device))
        for i, h in zip(idx, hyp.tolist()):
            results.append((i, sp.decode(strip_ids(h))))
    gathered = [None] * world_size
    dist.all_gather_object(gathered, results)
    model.train()
    if rank != 0:
        return None
    hyps = dict(kv for part in gathered for kv in part)
    ordered = [hyps[i] for i in range(len(valid_pairs))]
    return sacrebleu.corpus_bleu(ordered, [refs]).score


def inverse_sqrt(step, warmup):
    step = max(step, 1)
    return min(step / warmup, math.sqrt(warmup / step))


def main():
    args = parse_args()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    sp = spm.SentencePieceProcessor(model_file=args.spm_model)
    train_pairs = read_parallel(os.path.join(args.data_dir, "train"), args.src, args.tgt, sp, args.max_len)
    valid_pairs = read_parallel(os.path.join(args.data_dir, "valid"), args.src, args.tgt, sp, args.max_len)
    with open(os.path.join(args.data_dir, f"valid.{args.tgt}"), encoding="utf-8") as f:
        valid_refs = [line.strip() for line in f]

    lengths = [max(len(s), len(t)) for s, t in train_pairs]
    batch_sampler = ShardedTokenBatchSampler(lengths, args.max_tokens, rank, world_size, seed=args.seed)
    train_loader = DataLoader(ParallelDataset(train_pairs), batch_sampler=batch_sampler,
                              collate_fn=collate, num_workers=4, pin_memory=True)

    vocab = sp.get_piece_size()
    model = Seq2SeqTransformer(vocab, args.d_model, args.layers).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: inverse_sqrt(s, args.warmup))

    writer = SummaryWriter(os.path.join(args.save_dir, "tb")) if rank == 0 else None
    os.makedirs(args.save_dir, exist_ok=True)
    step, best_bleu = 0, -1.0
    for epoch in range(args.epochs):
        batch_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for src, tgt in train_loader:
            src = src.to(device, non_blocking=True)
            tgt = tgt.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(src, tgt[:, :-1])
            gold = tgt[:, 1:]
            loss = F.cross_entropy(logits.float().reshape(-1, vocab), gold.reshape(-1),
                                   ignore_index=PAD, label_smoothing=args.label_smoothing,
                                   reduction="sum")
            ntok = gold.ne(PAD).sum()
            opt.zero_grad(set_to_none=True)
            (loss / ntok).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % args.log_every == 0:
                stats = torch.stack([loss.detach(), ntok.float()])
                dist.all_reduce(stats)
                if rank == 0:
                    nll = (stats[0] / stats[1]).item()
                    writer.add_scalar("train/loss", nll, step)
                    writer.add_scalar("train/lr", sched.get_last_lr()[0], step)
                    print(f"epoch {epoch} step {step} loss {nll:.3f} {time.time() - t0:.0f}s", flush=True)

        bleu = evaluate_bleu(model.module, valid_pairs, sp, valid_refs, rank, world_size, device)
        if rank == 0:
            writer.add_scalar("valid/bleu", bleu, step)
            print(f"epoch {epoch} valid BLEU {bleu:.2f}", flush=True)
            ckpt = {"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                    "epoch": epoch, "step": step, "bleu": bleu}
            torch.save(ckpt, os.path.join(args.save_dir, "checkpoint_last.pt"))
            if bleu > best_bleu:
                best_bleu = bleu
                torch.save(ckpt, os.path.join(args.save_dir, "checkpoint_best.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
