"""Reproduce "Scaling NMT" (Ott et al. 2018) transformer-big En-De in a plain PyTorch loop.

Paper setup: ~25k source+target tokens per update, lr 1e-3, 4k warmup updates,
inverse-sqrt decay, label smoothing 0.1, average the last 5 checkpoints.

    torchrun --nproc_per_node=8 09_wmt14_ende_scaling.py --data data/wmt16_en_de_bpe32k
"""
import argparse
import collections
import contextlib
import glob
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

PAD, EOS, BOS = 1, 2, 0


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="dir with train.pt / valid.pt produced by binarize.py")
    p.add_argument("--save-dir", default="checkpoints/scaling_nmt")
    p.add_argument("--max-tokens", type=int, default=3584, help="tokens per GPU per forward")
    p.add_argument("--tokens-per-update", type=int, default=25000)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-updates", type=int, default=4000)
    p.add_argument("--max-update", type=int, default=30000)
    p.add_argument("--save-interval-updates", type=int, default=1000)
    p.add_argument("--keep-last", type=int, default=5)
    p.add_argument("--seed", type=int, default=2)
    return p.parse_args()


def make_batches(src_lens, tgt_lens, max_tokens):
    order = np.lexsort((src_lens, tgt_lens))
    batches, cur, longest = [], [], 0
    for i in order:
        n = max(src_lens[i], tgt_lens[i])
        if cur and max(longest, n) * (len(cur) + 1) > max_tokens:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        batches.append(cur)
    return batches


def epoch_batches(batches, epoch, seed, rank, world):
    perm = np.random.default_rng(seed + epoch).permutation(len(batches))
    usable = len(perm) - len(perm) % world
    return [batches[j] for j in perm[:usable][rank::world]]


def to_tensors(data, idx, device):
    src = [data["src"][i] for i in idx]
    tgt = [data["tgt"][i] for i in idx]
    S, T = max(map(len, src)), max(map(len, tgt))
    s = torch.full((len(idx), S), PAD, dtype=torch.long)
    p = torch.full((len(idx), T), PAD, dtype=torch.long)
    t = torch.full((len(idx), T), PAD, dtype=torch.long)
    for k, (a, b) in enumerate(zip(src, tgt)):
        s[k, -len(a):] = torch.as_tensor(a)  # left-pad source
        t[k, : len(b)] = torch.as_tensor(b)
        p[k, 0] = EOS
        p[k, 1: len(b)] = torch.as_tensor(b[:-1])
    return s.to(device, non_blocking=True), p.to(device, non_blocking=True), t.to(device, non_blocking=True)


class TransformerBig(nn.Module):
    def __init__(self, vocab, d=1024, heads=16, ffn=4096, layers=6, dropout=0.3):
        super().__init__()
        self.embed = nn.Embedding(vocab, d, padding_idx=PAD)
        nn.init.normal_(self.embed.weight, mean=0, std=d ** -0.5)
        nn.init.constant_(self.embed.weight[PAD], 0)
        half = d // 2
        freq = torch.exp(torch.arange(half, dtype=torch.float) * -(math.log(10000) / (half - 1)))
        ang = torch.arange(1024, dtype=torch.float).unsqueeze(1) * freq.unsqueeze(0)
        self.register_buffer("sinusoid", torch.cat([ang.sin(), ang.cos()], 1), persistent=False)
        self.model = nn.Transformer(d, heads, layers, layers, ffn, dropout, batch_first=True)
        self.drop = nn.Dropout(dropout)
        self.scale = math.sqrt(d)

    def _embed(self, x):
        positions = (x.ne(PAD).cumsum(1) * x.ne(PAD)).clamp(max=1023)
        return self.drop(self.embed(x) * self.scale + self.sinusoid[positions])

    def forward(self, src, prev):
        T = prev.size(1)
        causal = torch.triu(torch.full((T, T), float("-inf"), device=prev.device), 1)
        h = self.model(self._embed(src), self._embed(prev), tgt_mask=causal,
                       src_key_padding_mask=src.eq(PAD), tgt_key_padding_mask=prev.eq(PAD),
                       memory_key_padding_mask=src.eq(PAD))
        return F.linear(h, self.embed.weight)


def ls_xent(logits, tgt, eps=0.1):
    lprobs = F.log_softmax(logits, -1, dtype=torch.float32).view(-1, logits.size(-1))
    tgt = tgt.view(-1)
    keep = tgt.ne(PAD)
    nll = -lprobs.gather(1, tgt.unsqueeze(1)).squeeze(1)[keep].sum()
    smooth = -lprobs.sum(1)[keep].sum()
    eps_i = eps / (lprobs.size(1) - 1)
    return (1 - eps - eps_i) * nll + eps_i * smooth, nll, keep.sum()


def average_checkpoints(paths):
    avg = collections.OrderedDict()
    for p in paths:
        sd = torch.load(p, map_location="cpu")["model"]
        for k, v in sd.items():
            avg[k] = avg.get(k, 0) + v.float() / len(paths)
    return avg


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    train = torch.load(os.path.join(args.data, "train.pt"))
    valid = torch.load(os.path.join(args.data, "valid.pt"))
    vocab = len(train["dict"])
    train_batches = make_batches([len(x) for x in train["src"]], [len(x) for x in train["tgt"]], args.max_tokens)
    valid_batches = make_batches([len(x) for x in valid["src"]], [len(x) for x in valid["tgt"]], args.max_tokens)

    # accumulate gradients until an update has seen ~tokens_per_update tokens, as in the paper
    update_freq = max(1, args.tokens_per_update // args.max_tokens)

    model = DDP(TransformerBig(vocab).to(dev), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-8)
    warm = args.warmup_updates
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda u: (u + 1) / warm if u < warm else (warm / (u + 1)) ** 0.5)
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        print(f"| {len(train_batches)} batches/epoch, update_freq {update_freq}, world {world}", flush=True)

    updates, epoch = 0, 0
    t0 = time.time()
    while updates < args.max_update:
        epoch += 1
        model.train()
        mine = epoch_batches(train_batches, epoch, args.seed, rank, world)
        mine = mine[: len(mine) - len(mine) % update_freq]
        for i, idx in enumerate(mine):
            src, prev, tgt = to_tensors(train, idx, dev)
            sync = (i + 1) % update_freq == 0
            with (model.no_sync() if not sync else contextlib.nullcontext()):
                with torch.autocast("cuda", dtype=torch.float16):
                    logits = model(src, prev)
                loss, nll, ntok = ls_xent(logits, tgt)
                (loss / ntok / update_freq).backward()
            if not sync:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 25.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            updates += 1
            if updates % 100 == 0 and rank == 0:
                print(f"| ep {epoch} | upd {updates} | nll {(nll / ntok).item() / math.log(2):.3f} "
                      f"| lr {sched.get_last_lr()[0]:.3e} | {time.time() - t0:.0f}s", flush=True)

            if updates % args.save_interval_updates == 0:
                model.eval()
                acc = torch.zeros(2, device=dev)
                with torch.no_grad():
                    for vidx in valid_batches[rank::world]:
                        s, p, t = to_tensors(valid, vidx, dev)
                        _, vnll, vtok = ls_xent(model.module(s, p), t)
                        acc += torch.stack([vnll, vtok.float()])
                dist.all_reduce(acc)
                model.train()
                if rank == 0:
                    vl = (acc[0] / acc[1]).item() / math.log(2)
                    print(f"| valid | upd {updates} | nll {vl:.3f} | ppl {2 ** vl:.2f}", flush=True)
                    torch.save({"model": model.module.state_dict(), "updates": updates, "valid_nll": vl},
                               os.path.join(args.save_dir, f"checkpoint_{updates}.pt"))
                    ckpts = sorted(glob.glob(os.path.join(args.save_dir, "checkpoint_*.pt")),
                                   key=lambda x: int(x.rsplit("_", 1)[1][:-3]))
                    for old in ckpts[: -args.keep_last]:
                        os.remove(old)
                dist.barrier()
            if updates >= args.max_update:
                break

    if rank == 0:
        ckpts = sorted(glob.glob(os.path.join(args.save_dir, "checkpoint_*.pt")),
                       key=lambda x: int(x.rsplit("_", 1)[1][:-3]))[-args.keep_last:]
        torch.save({"model": average_checkpoints(ckpts), "averaged": ckpts},
                   os.path.join(args.save_dir, "checkpoint_avg_last5.pt"))
        print(f"| averaged {len(ckpts)} checkpoints", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
