#!/usr/bin/env python3
"""Transformer-big WMT En-De, fairseq-style training loop without fairseq.

Two nodes x 8 GPUs (run the same line on both nodes; HEAD is the first node's hostname):
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_id=$SLURM_JOB_ID --rdzv_backend=c10d \
        --rdzv_endpoint=$HEAD:29400 17_wmt_transformer_big_multinode.py \
        --data /nfs/data/wmt14_en_de_spm --save-dir /nfs/ckpt/tbig_ende --fp16 --update-freq 2
"""
import argparse
import collections
import contextlib
import glob
import math
import os
import random
import re
import time

import sacrebleu
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter


def options():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--max-tokens", type=int, default=3584)
    p.add_argument("--update-freq", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-updates", type=int, default=4000)
    p.add_argument("--max-update", type=int, default=300000)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--clip-norm", type=float, default=0.0)
    p.add_argument("--dropout", type=float, default=0.3)
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--save-interval-updates", type=int, default=2000)
    p.add_argument("--keep-last", type=int, default=10)
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args()


class TransformerBig(nn.Module):
    def __init__(self, vocab, pad, d=1024, ffn=4096, heads=16, layers=6, dropout=0.3, max_pos=1024):
        super().__init__()
        self.pad, self.scale = pad, math.sqrt(d)
        self.embed = nn.Embedding(vocab, d, padding_idx=pad)
        nn.init.normal_(self.embed.weight, 0, d ** -0.5)
        self.pos = nn.Embedding(max_pos, d)
        enc_layer = nn.TransformerEncoderLayer(d, heads, ffn, dropout, batch_first=True, norm_first=True)
        dec_layer = nn.TransformerDecoderLayer(d, heads, ffn, dropout, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(enc_layer, layers, norm=nn.LayerNorm(d), enable_nested_tensor=False)
        self.decoder = nn.TransformerDecoder(dec_layer, layers, norm=nn.LayerNorm(d))
        self.drop = nn.Dropout(dropout)

    def embed_tokens(self, x):
        pos = torch.arange(x.size(1), device=x.device)
        return self.drop(self.embed(x) * self.scale + self.pos(pos))

    def forward(self, src, prev):
        spad, tpad = src.eq(self.pad), prev.eq(self.pad)
        mem = self.encoder(self.embed_tokens(src), src_key_padding_mask=spad)
        causal = torch.ones(prev.size(1), prev.size(1), dtype=torch.bool, device=prev.device).triu(1)
        h = self.decoder(self.embed_tokens(prev), mem, tgt_mask=causal, tgt_key_padding_mask=tpad,
                         memory_key_padding_mask=spad)
        return F.linear(h, self.embed.weight)


def load(data, split, sp, max_len=250):
    src = sp.encode([l.rstrip("\n") for l in open(f"{data}/{split}.en", encoding="utf-8")])
    ref = [l.rstrip("\n") for l in open(f"{data}/{split}.de", encoding="utf-8")]
    tgt = sp.encode(ref)
    keep = [i for i in range(len(src)) if 0 < len(src[i]) < max_len and 0 < len(tgt[i]) < max_len]
    return [(src[i] + [sp.eos_id()], [sp.eos_id()] + tgt[i], tgt[i] + [sp.eos_id()], ref[i]) for i in keep]


def token_batches(ds, max_tokens):
    order = sorted(range(len(ds)), key=lambda i: (len(ds[i][0]), len(ds[i][1])))
    out, cur, width = [], [], 0
    for i in order:
        n = max(len(ds[i][0]), len(ds[i][1]))
        if cur and max(width, n) * (len(cur) + 1) > max_tokens:
            out.append(cur)
            cur, width = [], 0
        cur.append(i)
        width = max(width, n)
    if cur:
        out.append(cur)
    return out


def epoch_iterator(batches, epoch, seed, rank, world, update_freq):
    """Same shuffled batch list on every rank; ranks that run out get a dummy batch whose loss is
    zeroed, so all ranks do the same number of forward/backward passes (as fairseq does)."""
    order = list(batches)
    random.Random(seed + epoch).shuffle(order)
    mine = order[rank::world]
    steps = math.ceil(len(order) / world)
    steps = math.ceil(steps / update_freq) * update_freq
    for k in range(steps):
        if k < len(mine):
            yield mine[k], False
        else:
            yield order[0], True


def make_batch(ds, idx, pad, device):
    pad_t = lambda col: nn.utils.rnn.pad_sequence([torch.tensor(ds[i][col]) for i in idx], batch_first=True,
                                                  padding_value=pad).to(device, non_blocking=True)
    return pad_t(0), pad_t(1), pad_t(2)


def ls_loss(logits, target, eps, pad):
    lp = F.log_softmax(logits.float(), -1)
    mask = target.ne(pad)
    nll = -lp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    smooth = -lp.mean(-1)
    return ((1 - eps) * nll + eps * smooth)[mask].sum(), nll[mask].sum()


def average_checkpoints(paths):
    avg, n = collections.OrderedDict(), len(paths)
    for p in paths:
        sd = torch.load(p, map_location="cpu")["model"]
        for k, v in sd.items():
            k = k[len("module."):] if k.startswith("module.") else k
            avg[k] = avg.get(k, 0) + v.float() / n
    return avg


@torch.no_grad()
def valid_bleu(model, ds, sp, device, rank, world, max_tokens):
    model.eval()
    hyps = []
    for idx in token_batches(ds, max_tokens)[rank::world]:
        src, _, _ = make_batch(ds, idx, model.pad, device)
        ys = torch.full((len(idx), 1), sp.eos_id(), dtype=torch.long, device=device)
        finished = torch.zeros(len(idx), dtype=torch.bool, device=device)
        for _ in range(src.size(1) + 50):
            with torch.autocast("cuda", dtype=torch.float16):
                nxt = model(src, ys)[:, -1].argmax(-1)
            nxt = nxt.masked_fill(finished, model.pad)
            ys = torch.cat([ys, nxt[:, None]], 1)
            finished |= nxt.eq(sp.eos_id())
            if finished.all():
                break
        for i, row in zip(idx, ys[:, 1:].tolist()):
            hyps.append((i, sp.decode([t for t in row if t not in (model.pad, sp.eos_id())])))
    parts = [None] * world
    dist.all_gather_object(parts, hyps)
    model.train()
    merged = dict(h for part in parts for h in part)
    return sacrebleu.corpus_bleu([merged[i] for i in range(len(ds))], [[d[3] for d in ds]]).score


def main():
    args = options()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    sp = spm.SentencePieceProcessor(model_file=os.path.join(args.data, "spm.model"))
    pad = sp.pad_id()
    train = load(args.data, "train", sp)
    valid = load(args.data, "valid", sp)
    batches = token_batches(train, args.max_tokens)

    model = TransformerBig(sp.get_piece_size(), pad, dropout=args.dropout).to(device)
    ddp = DDP(model, device_ids=[local_rank], bucket_cap_mb=100)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-8)
    inv_sqrt = lambda u: min((u + 1) / args.warmup_updates, math.sqrt(args.warmup_updates / (u + 1)))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, inv_sqrt)
    scaler = torch.cuda.amp.GradScaler(enabled=args.fp16, init_scale=128.0)

    num_updates, epoch = 0, 0
    last = os.path.join(args.save_dir, "checkpoint_last.pt")
    if os.path.exists(last):
        st = torch.load(last, map_location="cpu")
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optimizer"])
        sched.load_state_dict(st["scheduler"])
        scaler.load_state_dict(st["scaler"])
        num_updates, epoch = st["num_updates"], st["epoch"]
    writer = None
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.save_dir, "tb"))

    while num_updates < args.max_update:
        epoch += 1
        ddp.train()
        t0 = time.time()
        micro, acc = 0, torch.zeros(3, device=device)  # loss, nll, ntokens
        for idx, is_dummy in epoch_iterator(batches, epoch, args.seed, rank, world, args.update_freq):
            src, prev, tgt = make_batch(train, idx, pad, device)
            micro += 1
            sync = micro % args.update_freq == 0
            with ddp.no_sync() if not sync else contextlib.nullcontext():
                with torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16):
                    logits = ddp(src, prev)
                loss, nll = ls_loss(logits, tgt, args.label_smoothing, pad)
                if is_dummy:
                    loss, nll = loss * 0.0, nll * 0.0
                scaler.scale(loss).backward()
            ntok = torch.zeros((), device=device) if is_dummy else tgt.ne(pad).sum().float()
            acc += torch.stack([loss.detach(), nll.detach(), ntok])
            if not sync:
                continue

            # gradients are summed token losses averaged over ranks; renormalise by the global token count
            stats = acc.clone()
            dist.all_reduce(stats)
            scaler.unscale_(opt)
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(world / stats[2].clamp(min=1))
            gnorm = nn.utils.clip_grad_norm_(model.parameters(), args.clip_norm if args.clip_norm > 0 else float("inf"))
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            sched.step()
            num_updates += 1
            acc.zero_()

            if rank == 0 and num_updates % 100 == 0:
                writer.add_scalar("train/loss", (stats[0] / stats[2] / math.log(2)).item(), num_updates)
                writer.add_scalar("train/nll", (stats[1] / stats[2] / math.log(2)).item(), num_updates)
                writer.add_scalar("train/lr", sched.get_last_lr()[0], num_updates)
                writer.add_scalar("train/gnorm", gnorm.item(), num_updates)
                writer.add_scalar("train/loss_scale", scaler.get_scale(), num_updates)

            if num_updates % args.save_interval_updates == 0:
                bleu = valid_bleu(model, valid, sp, device, rank, world, args.max_tokens)
                if rank == 0:
                    writer.add_scalar("valid/bleu", bleu, num_updates)
                    print(f"| epoch {epoch} | updates {num_updates} | valid BLEU {bleu:.2f} "
                          f"| {time.time() - t0:.0f}s", flush=True)
                    state = {"model": model.state_dict(), "optimizer": opt.state_dict(),
                             "scheduler": sched.state_dict(), "scaler": scaler.state_dict(),
                             "num_updates": num_updates, "epoch": epoch - 1, "bleu": bleu}
                    torch.save(state, os.path.join(args.save_dir, f"checkpoint_{epoch}_{num_updates}.pt"))
                    torch.save(state, last + ".tmp")
                    os.replace(last + ".tmp", last)
                    old = sorted(glob.glob(os.path.join(args.save_dir, "checkpoint_*_*.pt")),
                                 key=lambda p: int(re.findall(r"_(\d+)\.pt$", p)[0]))
                    for p in old[:-args.keep_last]:
                        os.remove(p)
                dist.barrier()
            if num_updates >= args.max_update:
                break

    if rank == 0:
        keep = sorted(glob.glob(os.path.join(args.save_dir, "checkpoint_*_*.pt")),
                      key=lambda p: int(re.findall(r"_(\d+)\.pt$", p)[0]))[-5:]
        torch.save({"model": average_checkpoints(keep)}, os.path.join(args.save_dir, "checkpoint_avg5.pt"))
        writer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
