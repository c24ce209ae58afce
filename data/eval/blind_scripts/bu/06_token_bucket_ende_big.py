"""Transformer-big En-De with max-tokens batching and encoder/decoder LayerDrop.

Gradients are normalised by the number of target tokens summed over all
workers (as fairseq does), so the effective loss does not depend on how the
tokens happen to be spread over the GPUs.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        06_token_bucket_ende_big.py --data /shared/wmt14_ende_bin --save-dir /shared/ckpt/ende_big
"""
import argparse
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler

PAD, BOS, EOS = 1, 0, 2


class BinarizedBitext(Dataset):
    """Reads the {split}.src.npy / {split}.tgt.npy + offsets produced by our preprocess.py."""

    def __init__(self, root, split):
        self.src = np.load(os.path.join(root, f"{split}.src.npy"), mmap_mode="r")
        self.tgt = np.load(os.path.join(root, f"{split}.tgt.npy"), mmap_mode="r")
        self.src_off = np.load(os.path.join(root, f"{split}.src.off.npy"))
        self.tgt_off = np.load(os.path.join(root, f"{split}.tgt.off.npy"))
        self.src_sizes = np.diff(self.src_off)
        self.tgt_sizes = np.diff(self.tgt_off)

    def __len__(self):
        return len(self.src_sizes)

    def __getitem__(self, i):
        s = torch.from_numpy(np.array(self.src[self.src_off[i]:self.src_off[i + 1]], dtype=np.int64))
        t = torch.from_numpy(np.array(self.tgt[self.tgt_off[i]:self.tgt_off[i + 1]], dtype=np.int64))
        return s, t


class DistributedTokenBatchSampler(Sampler):
    """Buckets by length, packs up to max_tokens (padded) per batch, shards batches over ranks."""

    def __init__(self, src_sizes, tgt_sizes, max_tokens, rank, world_size, seed=1, max_len=256):
        self.rank, self.world_size, self.seed, self.epoch = rank, world_size, seed, 0
        sizes = np.maximum(src_sizes, tgt_sizes)
        order = np.lexsort((src_sizes, tgt_sizes))
        order = order[sizes[order] <= max_len]
        batches, cur, cur_max = [], [], 0
        for idx in order:
            n = int(sizes[idx])
            if cur and max(cur_max, n) * (len(cur) + 1) > max_tokens:
                batches.append(cur)
                cur, cur_max = [], 0
            cur.append(int(idx))
            cur_max = max(cur_max, n)
        if cur:
            batches.append(cur)
        self.batches = batches
        self.num_per_rank = math.ceil(len(batches) / world_size)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        g = np.random.RandomState(self.seed + self.epoch)
        perm = g.permutation(len(self.batches)).tolist()
        total = self.num_per_rank * self.world_size
        perm += perm[: total - len(perm)]
        for b in perm[self.rank:total:self.world_size]:
            yield self.batches[b]

    def __len__(self):
        return self.num_per_rank


def collate(samples):
    B = len(samples)
    S = max(len(s) for s, _ in samples)
    T = max(len(t) for _, t in samples)
    src = torch.full((B, S), PAD, dtype=torch.long)
    prev = torch.full((B, T), PAD, dtype=torch.long)
    tgt = torch.full((B, T), PAD, dtype=torch.long)
    for i, (s, t) in enumerate(samples):
        src[i, : len(s)] = s
        tgt[i, : len(t)] = t
        prev[i, 0] = EOS  # fairseq convention: decoder input starts with </s>
        prev[i, 1: len(t)] = t[:-1]
    return src, prev, tgt


class Layer(nn.Module):
    def __init__(self, d, h, ffn, p, cross=False):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d, h, dropout=p, batch_first=True)
        self.cross_attn = nn.MultiheadAttention(d, h, dropout=p, batch_first=True) if cross else None
        self.ff = nn.Sequential(nn.Linear(d, ffn), nn.ReLU(), nn.Dropout(p), nn.Linear(ffn, d))
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(3 if cross else 2))
        self.drop = nn.Dropout(p)

    def forward(self, x, pad_mask, causal=None, mem=None, mem_mask=None):
        y = self.norms[0](x)
        x = x + self.drop(self.self_attn(y, y, y, key_padding_mask=pad_mask, attn_mask=causal,
                                         need_weights=False)[0])
        if self.cross_attn is not None:
            y = self.norms[1](x)
            x = x + self.drop(self.cross_attn(y, mem, mem, key_padding_mask=mem_mask, need_weights=False)[0])
        return x + self.drop(self.ff(self.norms[-1](x)))


class TransformerBig(nn.Module):
    def __init__(self, vocab, d=1024, h=16, ffn=4096, layers=6, p=0.3, layerdrop=0.1):
        super().__init__()
        self.embed = nn.Embedding(vocab, d, padding_idx=PAD)
        nn.init.normal_(self.embed.weight, 0, d ** -0.5)
        self.pos = nn.Embedding(1024, d)
        self.enc = nn.ModuleList(Layer(d, h, ffn, p) for _ in range(layers))
        self.dec = nn.ModuleList(Layer(d, h, ffn, p, cross=True) for _ in range(layers))
        self.enc_ln, self.dec_ln = nn.LayerNorm(d), nn.LayerNorm(d)
        self.drop, self.scale, self.layerdrop = nn.Dropout(p), math.sqrt(d), layerdrop

    def _embed(self, x):
        return self.drop(self.embed(x) * self.scale + self.pos(torch.arange(x.size(1), device=x.device)))

    def _layers(self, layers):
        for layer in layers:
            if self.training and random.random() < self.layerdrop:
                continue
            yield layer

    def forward(self, src, prev):
        smask = src.eq(PAD)
        x = self._embed(src)
        for layer in self._layers(self.enc):
            x = layer(x, smask)
        mem = self.enc_ln(x)
        T = prev.size(1)
        causal = torch.triu(torch.ones(T, T, dtype=torch.bool, device=prev.device), 1)
        y = self._embed(prev)
        for layer in self._layers(self.dec):
            y = layer(y, prev.eq(PAD), causal, mem, smask)
        return F.linear(self.dec_ln(y), self.embed.weight)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--save-dir", required=True)
    ap.add_argument("--vocab-size", type=int, default=32768)
    ap.add_argument("--max-tokens", type=int, default=3584)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup-updates", type=int, default=4000)
    ap.add_argument("--max-update", type=int, default=300000)
    ap.add_argument("--label-smoothing", type=float, default=0.1)
    ap.add_argument("--clip-norm", type=float, default=0.0)
    ap.add_argument("--save-interval-updates", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    random.seed(args.seed + rank)  # layerdrop / dropout differ per worker on purpose

    train = BinarizedBitext(args.data, "train")
    bsampler = DistributedTokenBatchSampler(train.src_sizes, train.tgt_sizes, args.max_tokens,
                                            rank, world, seed=args.seed)
    loader = DataLoader(train, batch_sampler=bsampler, collate_fn=collate, num_workers=4, pin_memory=True)

    model = TransformerBig(args.vocab_size).to(dev)
    # layers skipped by LayerDrop get no gradient in that step
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-8)
    w = args.warmup_updates
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / w, math.sqrt(w / (s + 1))))

    num_updates, epoch = 0, 1
    last = os.path.join(args.save_dir, "checkpoint_last.pt")
    if os.path.exists(last):
        ckpt = torch.load(last, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["lr_scheduler"])
        num_updates, epoch = ckpt["num_updates"], ckpt["epoch"]
        if rank == 0:
            print(f"| resumed from {last} at update {num_updates}", flush=True)
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)

    eps = args.label_smoothing
    while num_updates < args.max_update:
        bsampler.set_epoch(epoch)
        model.train()
        for src, prev, tgt in loader:
            src, prev, tgt = src.to(dev, non_blocking=True), prev.to(dev, non_blocking=True), tgt.to(dev, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(src, prev)
            lp = F.log_softmax(logits.float(), -1)
            keep = tgt.ne(PAD)
            nll = -lp.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)[keep].sum()
            smooth = -lp.sum(-1)[keep].sum()
            eps_i = eps / (lp.size(-1) - 1)
            loss = (1 - eps - eps_i) * nll + eps_i * smooth

            # total target tokens in this update over all workers
            sample_size = keep.sum().float()
            dist.all_reduce(sample_size)
            opt.zero_grad(set_to_none=True)
            # DDP averages over world, so scale back up before dividing by the global token count
            (loss * world / sample_size).backward()
            if args.clip_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_norm)
            opt.step()
            sched.step()
            num_updates += 1

            if num_updates % 100 == 0:
                stats = torch.stack([loss.detach(), nll.detach()]) / sample_size
                dist.all_reduce(stats)
                if rank == 0:
                    print(f"| epoch {epoch:03d} | upd {num_updates} | loss {stats[0].item() / math.log(2):.3f} "
                          f"| nll {stats[1].item() / math.log(2):.3f} | lr {sched.get_last_lr()[0]:.3e}", flush=True)
            if num_updates % args.save_interval_updates == 0:
                if rank == 0:
                    state = {"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                             "lr_scheduler": sched.state_dict(), "num_updates": num_updates, "epoch": epoch}
                    torch.save(state, last + ".tmp")
                    os.replace(last + ".tmp", last)
                    torch.save(state["model"], os.path.join(args.save_dir, f"checkpoint_{epoch}_{num_updates}.pt"))
                dist.barrier()
            if num_updates >= args.max_update:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
