#!/usr/bin/env python3
# Transformer-base NMT trained on pre-binarised sentencepiece ids with token-budget batches.
#
#   torchrun --nnodes=1 --nproc_per_node=4 03_nmt_token_batches.py \
#       --data data-bin/wmt17_de_en --save-dir checkpoints/de_en_base --max-tokens 8192
import argparse
import logging
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler

log = logging.getLogger(__name__)
PAD, BOS, EOS = 0, 1, 2


class ParallelCorpus(Dataset):
    """Reads <split>.src.npy / <split>.tgt.npy (object arrays of int32 id arrays)."""

    def __init__(self, data_dir, split, max_positions):
        src = np.load(os.path.join(data_dir, f"{split}.src.npy"), allow_pickle=True)
        tgt = np.load(os.path.join(data_dir, f"{split}.tgt.npy"), allow_pickle=True)
        keep = [i for i in range(len(src))
                if 0 < len(src[i]) <= max_positions and 0 < len(tgt[i]) + 1 <= max_positions]
        self.src = [src[i] for i in keep]
        self.tgt = [tgt[i] for i in keep]
        self.src_lens = np.array([len(s) for s in self.src])
        self.tgt_lens = np.array([len(t) + 1 for t in self.tgt])

    def __len__(self):
        return len(self.src)

    def __getitem__(self, i):
        return torch.from_numpy(self.src[i].astype(np.int64)), torch.from_numpy(self.tgt[i].astype(np.int64))


def collate(samples):
    src, tgt = zip(*samples)
    src = nn.utils.rnn.pad_sequence(src, batch_first=True, padding_value=PAD)
    tgt_in = nn.utils.rnn.pad_sequence([torch.cat([torch.tensor([BOS]), t]) for t in tgt],
                                       batch_first=True, padding_value=PAD)
    tgt_out = nn.utils.rnn.pad_sequence([torch.cat([t, torch.tensor([EOS])]) for t in tgt],
                                        batch_first=True, padding_value=PAD)
    return src, tgt_in, tgt_out


class TokenBudgetSampler(Sampler):
    def __init__(self, src_lens, tgt_lens, max_tokens, num_replicas, rank, shuffle=True, seed=1):
        self.sizes = np.maximum(src_lens, tgt_lens)
        self.max_tokens = max_tokens
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _batches(self):
        rng = np.random.RandomState(self.seed + self.epoch)
        indices = np.arange(len(self.sizes))
        if self.shuffle:
            rng.shuffle(indices)
        # each rank takes its slice of the shuffled corpus, then batches it by length
        indices = indices[self.rank::self.num_replicas]
        indices = indices[np.argsort(self.sizes[indices], kind="mergesort")]
        batches, cur, cur_max = [], [], 0
        for idx in indices:
            n = self.sizes[idx]
            if cur and max(cur_max, n) * (len(cur) + 1) > self.max_tokens:
                batches.append(cur)
                cur, cur_max = [], 0
            cur.append(int(idx))
            cur_max = max(cur_max, n)
        if cur:
            batches.append(cur)
        if self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        return batches

    def __iter__(self):
        return iter(self._batches())

    def __len__(self):
        return len(self._batches())


class PositionalEncoding(nn.Module):
    def __init__(self, dim, max_len=1024):
        super().__init__()
        pe = torch.zeros(max_len, dim)
        pos = torch.arange(max_len).unsqueeze(1)
        div = torch.exp(torch.arange(0, dim, 2) * (-math.log(10000.0) / dim))
        pe[:, 0::2] = torch.sin(pos * div)
        pe[:, 1::2] = torch.cos(pos * div)
        self.register_buffer("pe", pe, persistent=False)

    def forward(self, x):
        return x + self.pe[: x.size(1)]


class Seq2SeqTransformer(nn.Module):
    def __init__(self, vocab_size, dim=512, heads=8, layers=6, ffn=2048, dropout=0.1):
        super().__init__()
        self.dim = dim
        self.embed = nn.Embedding(vocab_size, dim, padding_idx=PAD)  # joint vocab, shared
        self.pos = PositionalEncoding(dim)
        self.drop = nn.Dropout(dropout)
        self.transformer = nn.Transformer(dim, heads, layers, layers, ffn, dropout,
                                          batch_first=True, norm_first=True)
        self.out = nn.Linear(dim, vocab_size, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, src, tgt_in):
        src_pad = src.eq(PAD)
        tgt_pad = tgt_in.eq(PAD)
        causal = self.transformer.generate_square_subsequent_mask(tgt_in.size(1), device=src.device,
                                                                  dtype=torch.bool)
        s = self.drop(self.pos(self.embed(src) * math.sqrt(self.dim)))
        t = self.drop(self.pos(self.embed(tgt_in) * math.sqrt(self.dim)))
        h = self.transformer(s, t, tgt_mask=causal, src_key_padding_mask=src_pad,
                             tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=src_pad)
        return self.out(h)


def inverse_sqrt(warmup):
    def f(step):
        step = max(step, 1)
        return min(step / warmup, math.sqrt(warmup / step))
    return f


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    nll = torch.zeros(2, device=device, dtype=torch.float64)
    for src, tgt_in, tgt_out in loader:
        src, tgt_in, tgt_out = src.to(device), tgt_in.to(device), tgt_out.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(src, tgt_in)
        nll[0] += F.cross_entropy(logits.float().flatten(0, 1), tgt_out.flatten(), ignore_index=PAD, reduction="sum")
        nll[1] += tgt_out.ne(PAD).sum()
    dist.all_reduce(nll)
    model.train()
    return (nll[0] / nll[1]).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--save-dir", required=True)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--max-positions", type=int, default=256)
    parser.add_argument("--lr", type=float, default=7e-4)
    parser.add_argument("--warmup-updates", type=int, default=4000)
    parser.add_argument("--label-smoothing", type=float, default=0.1)
    parser.add_argument("--max-epoch", type=int, default=40)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(message)s",
                        level=logging.INFO if rank == 0 else logging.ERROR)
    torch.manual_seed(args.seed)

    train = ParallelCorpus(args.data, "train", args.max_positions)
    valid = ParallelCorpus(args.data, "valid", args.max_positions)
    train_sampler = TokenBudgetSampler(train.src_lens, train.tgt_lens, args.max_tokens, world_size, rank, seed=args.seed)
    valid_sampler = TokenBudgetSampler(valid.src_lens, valid.tgt_lens, args.max_tokens, world_size, rank, shuffle=False)
    train_loader = DataLoader(train, batch_sampler=train_sampler, collate_fn=collate, num_workers=4, pin_memory=True)
    valid_loader = DataLoader(valid, batch_sampler=valid_sampler, collate_fn=collate, num_workers=2)
    log.info("train %d pairs, %d batches/epoch on rank 0", len(train), len(train_sampler))

    model = Seq2SeqTransformer(args.vocab_size).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, inverse_sqrt(args.warmup_updates))
    scaler = torch.cuda.amp.GradScaler()

    num_updates, best = 0, float("inf")
    os.makedirs(args.save_dir, exist_ok=True)
    for epoch in range(1, args.max_epoch + 1):
        train_sampler.set_epoch(epoch)
        model.train()
        start = time.time()
        for src, tgt_in, tgt_out in train_loader:
            src = src.to(device, non_blocking=True)
            tgt_in = tgt_in.to(device, non_blocking=True)
            tgt_out = tgt_out.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(src, tgt_in)
                loss = F.cross_entropy(logits.float().flatten(0, 1), tgt_out.flatten(),
                                       ignore_index=PAD, label_smoothing=args.label_smoothing)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            num_updates += 1
            if num_updates % 200 == 0:
                log.info("epoch %03d | updates %d | loss %.3f | lr %.3e | scale %.0f", epoch, num_updates,
                         loss.item(), scheduler.get_last_lr()[0], scaler.get_scale())

        valid_nll = validate(model.module, valid_loader, device)
        log.info("epoch %03d | %.1f min | valid nll %.3f | ppl %.2f", epoch, (time.time() - start) / 60,
                 valid_nll, math.exp(valid_nll))
        if rank == 0:
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                     "epoch": epoch, "num_updates": num_updates, "args": vars(args)}
            torch.save(state, os.path.join(args.save_dir, "checkpoint_last.pt"))
            if valid_nll < best:
                best = valid_nll
                torch.save(state, os.path.join(args.save_dir, "checkpoint_best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
