"""Long-input summariser (PubMed) with a 12+12 layer d=1024 transformer under FSDP.

ROUGE is computed offline by decode_pubmed.py on the saved full checkpoints;
here we only track label-smoothed loss / ppl on the validation split.

    torchrun --nproc_per_node=8 11_fsdp_pubmed_summarizer.py --data data/pubmed_tok --out runs/pubmed_fsdp
"""
import argparse
import functools
import math
import os
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from datasets import load_from_disk
from torch.distributed.fsdp import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--vocab-size", type=int, default=50265)
    ap.add_argument("--pad-id", type=int, default=1)
    ap.add_argument("--bos-id", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--update-freq", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--max-updates", type=int, default=50000)
    ap.add_argument("--save-every", type=int, default=2500)
    ap.add_argument("--eps", type=float, default=0.1)
    return ap.parse_args()


class EncoderBlock(nn.Module):
    def __init__(self, d, h, ffn, p):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, h, dropout=p, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, ffn), nn.GELU(), nn.Linear(ffn, d))
        self.drop = nn.Dropout(p)

    def forward(self, x, kpm):
        y = self.ln1(x)
        x = x + self.drop(self.attn(y, y, y, key_padding_mask=kpm, need_weights=False)[0])
        return x + self.drop(self.mlp(self.ln2(x)))


class DecoderBlock(nn.Module):
    def __init__(self, d, h, ffn, p):
        super().__init__()
        self.ln1, self.ln2, self.ln3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.self_attn = nn.MultiheadAttention(d, h, dropout=p, batch_first=True)
        self.cross_attn = nn.MultiheadAttention(d, h, dropout=p, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, ffn), nn.GELU(), nn.Linear(ffn, d))
        self.drop = nn.Dropout(p)

    def forward(self, y, mem, causal, kpm, mem_kpm):
        z = self.ln1(y)
        y = y + self.drop(self.self_attn(z, z, z, attn_mask=causal, key_padding_mask=kpm, need_weights=False)[0])
        z = self.ln2(y)
        y = y + self.drop(self.cross_attn(z, mem, mem, key_padding_mask=mem_kpm, need_weights=False)[0])
        return y + self.drop(self.mlp(self.ln3(y)))


class LongSummarizer(nn.Module):
    def __init__(self, vocab, pad, d=1024, h=16, ffn=4096, n_enc=12, n_dec=12, p=0.1, max_pos=4096):
        super().__init__()
        self.pad = pad
        self.embed = nn.Embedding(vocab, d, padding_idx=pad)
        self.enc_pos = nn.Embedding(max_pos, d)
        self.dec_pos = nn.Embedding(1024, d)
        self.encoder = nn.ModuleList(EncoderBlock(d, h, ffn, p) for _ in range(n_enc))
        self.decoder = nn.ModuleList(DecoderBlock(d, h, ffn, p) for _ in range(n_dec))
        self.enc_norm, self.dec_norm = nn.LayerNorm(d), nn.LayerNorm(d)
        self.drop = nn.Dropout(p)

    def forward(self, src, prev):
        kpm = src.eq(self.pad)
        x = self.drop(self.embed(src) + self.enc_pos(torch.arange(src.size(1), device=src.device)))
        for blk in self.encoder:
            x = blk(x, kpm)
        mem = self.enc_norm(x)
        T = prev.size(1)
        causal = torch.triu(torch.ones(T, T, dtype=torch.bool, device=src.device), 1)
        y = self.drop(self.embed(prev) + self.dec_pos(torch.arange(T, device=src.device)))
        for blk in self.decoder:
            y = blk(y, mem, causal, prev.eq(self.pad), kpm)
        return F.linear(self.dec_norm(y), self.embed.weight)


def make_collate(pad, bos):
    def collate(rows):
        src = [r["input_ids"] for r in rows]
        tgt = [r["labels"] for r in rows]
        S, T = max(map(len, src)), max(map(len, tgt))
        s = torch.full((len(rows), S), pad, dtype=torch.long)
        t = torch.full((len(rows), T), pad, dtype=torch.long)
        p = torch.full((len(rows), T), pad, dtype=torch.long)
        for i, (a, b) in enumerate(zip(src, tgt)):
            s[i, : len(a)] = torch.tensor(a)
            t[i, : len(b)] = torch.tensor(b)
            p[i, 0] = bos
            p[i, 1: len(b)] = torch.tensor(b[:-1])
        return s, p, t
    return collate


def ls_loss(logits, tgt, eps, pad):
    lp = F.log_softmax(logits.float(), -1)
    keep = tgt.ne(pad)
    nll = -lp.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)[keep]
    smooth = -lp.mean(-1)[keep]
    return ((1 - eps) * nll + eps * smooth).sum(), nll.sum(), keep.sum()


FULL_SAVE = (FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
             FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True))
FULL_LOAD = (FullStateDictConfig(offload_to_cpu=True, rank0_only=False),
             FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=False))


def save_full(model, optim, updates, path, rank):
    # every rank takes part in gathering; only rank 0 gets the tensors and writes them
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, *FULL_SAVE):
        msd = model.state_dict()
        osd = FSDP.optim_state_dict(model, optim)
    if rank == 0:
        torch.save({"model": msd, "optim": osd, "updates": updates}, path + ".tmp")
        os.replace(path + ".tmp", path)
    dist.barrier()


def load_full(model, optim, path):
    ckpt = torch.load(path, map_location="cpu")
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, *FULL_LOAD):
        model.load_state_dict(ckpt["model"])
        optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, ckpt["optim"]))
    return ckpt["updates"]


def main():
    args = get_args()
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    ds = load_from_disk(args.data)
    collate = make_collate(args.pad_id, args.bos_id)
    train_sampler = DistributedSampler(ds["train"], shuffle=True, drop_last=True)
    valid_sampler = DistributedSampler(ds["validation"], shuffle=False, drop_last=True)
    train_dl = DataLoader(ds["train"], batch_size=args.batch_size, sampler=train_sampler,
                          collate_fn=collate, num_workers=4, pin_memory=True)
    valid_dl = DataLoader(ds["validation"], batch_size=args.batch_size, sampler=valid_sampler,
                          collate_fn=collate, num_workers=2)

    model = LongSummarizer(args.vocab_size, args.pad_id)
    wrap = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={EncoderBlock, DecoderBlock})
    model = FSDP(model, auto_wrap_policy=wrap, sharding_strategy=ShardingStrategy.FULL_SHARD,
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                buffer_dtype=torch.bfloat16),
                 device_id=torch.cuda.current_device(), use_orig_params=True)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda s: min((s + 1) / args.warmup, math.sqrt(args.warmup / (s + 1))))

    os.makedirs(args.out, exist_ok=True)
    last = os.path.join(args.out, "last.pt")
    updates = 0
    if os.path.exists(last):
        updates = load_full(model, optim, last)
        for _ in range(updates):
            sched.step()
        if rank == 0:
            print(f"resumed at update {updates}", flush=True)

    dev = torch.device("cuda", local_rank)
    micro, epoch, t0 = 0, 0, time.time()
    running = torch.zeros(2, device=dev)
    while updates < args.max_updates:
        train_sampler.set_epoch(epoch)
        model.train()
        for src, prev, tgt in train_dl:
            src, prev, tgt = src.to(dev), prev.to(dev), tgt.to(dev)
            micro += 1
            boundary = micro % args.update_freq == 0
            with (nullcontext() if boundary else model.no_sync()):
                loss, nll, ntok = ls_loss(model(src, prev), tgt, args.eps, args.pad_id)
                (loss / ntok / args.update_freq).backward()
            running += torch.stack([nll.detach(), ntok.float()])
            if not boundary:
                continue
            model.clip_grad_norm_(1.0)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            updates += 1

            if updates % 50 == 0:
                dist.all_reduce(running)
                if rank == 0:
                    nll_tok = (running[0] / running[1]).item()
                    print(f"upd {updates} | nll {nll_tok:.3f} | ppl {math.exp(nll_tok):.1f} | "
                          f"lr {sched.get_last_lr()[0]:.2e} | {time.time() - t0:.0f}s", flush=True)
                running.zero_()

            if updates % args.save_every == 0:
                model.eval()
                v = torch.zeros(2, device=dev)
                with torch.no_grad():
                    for vs, vp, vt in valid_dl:
                        _, vnll, vtok = ls_loss(model(vs.to(dev), vp.to(dev)), vt.to(dev), args.eps, args.pad_id)
                        v += torch.stack([vnll, vtok.float()])
                dist.all_reduce(v)
                model.train()
                if rank == 0:
                    print(f"upd {updates} | valid nll {(v[0] / v[1]).item():.3f}", flush=True)
                save_full(model, optim, updates, last, rank)
                if rank == 0:
                    os.link(last, os.path.join(args.out, f"checkpoint_{updates}.pt"))
            if updates >= args.max_updates:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
