#!/usr/bin/env python3
# wav2vec 2.0 pretraining with token-budget batching (fairseq --max-tokens style).
# Utterances are grouped by length so that every batch holds ~max_tokens samples
# of audio, which avoids wasting compute on padding / cropping.
#
#   torchrun --nproc_per_node=8 03_w2v2_base_ls960.py --data /data/ls960 --max-tokens 1400000
import argparse
import logging
import math
import os
import random
import time
from dataclasses import dataclass

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

log = logging.getLogger(__name__)


@dataclass
class ModelCfg:
    conv: tuple = ((512, 10, 5),) + ((512, 3, 2),) * 4 + ((512, 2, 2),) * 2
    dim: int = 768
    layers: int = 12
    heads: int = 12
    ffn: int = 3072
    final_dim: int = 256
    groups: int = 2
    vars: int = 320
    negatives: int = 100
    logit_temp: float = 0.1


def out_frames(n, conv):
    for _, k, s in conv:
        n = (n - k) // s + 1
    return n


class Quantizer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.G, self.V = cfg.groups, cfg.vars
        self.proj = nn.Linear(512, self.G * self.V)
        self.codebook = nn.Parameter(torch.rand(self.G * self.V, cfg.final_dim // self.G))
        self.tau = 2.0

    def forward(self, feats):
        B, T, _ = feats.shape
        z = self.proj(feats).float().view(B * T, self.G, self.V)
        probs = z.softmax(-1).mean(0)
        ppl = torch.exp(-(probs * (probs + 1e-7).log()).sum(-1)).sum()
        onehot = F.gumbel_softmax(z, tau=self.tau, hard=True) if self.training else \
            F.one_hot(z.argmax(-1), self.V).float()
        cb = self.codebook.view(self.G, self.V, -1).float()
        q = torch.einsum("ngv,gvd->ngd", onehot, cb).reshape(B, T, -1)
        return q, ppl


class W2V2(nn.Module):
    def __init__(self, cfg: ModelCfg):
        super().__init__()
        self.cfg = cfg
        layers, c_in = [], 1
        for i, (c, k, s) in enumerate(cfg.conv):
            layers.append(nn.Conv1d(c_in, c, k, s, bias=False))
            if i == 0:
                layers.append(nn.GroupNorm(c, c))
            layers.append(nn.GELU())
            c_in = c
        self.cnn = nn.Sequential(*layers)
        self.ln = nn.LayerNorm(512)
        self.in_proj = nn.Linear(512, cfg.dim)
        self.mask_emb = nn.Parameter(torch.FloatTensor(cfg.dim).uniform_())
        self.pos = nn.Conv1d(cfg.dim, cfg.dim, 128, padding=64, groups=16)
        self.enc = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(cfg.dim, cfg.heads, cfg.ffn, 0.1, "gelu", batch_first=True, norm_first=True),
            cfg.layers, enable_nested_tensor=False)
        self.quantizer = Quantizer(cfg)
        self.q_proj = nn.Linear(cfg.final_dim, cfg.final_dim)
        self.out_proj = nn.Linear(cfg.dim, cfg.final_dim)

    def forward(self, wav, pad_mask, mask):
        f = self.ln(self.cnn(wav.unsqueeze(1)).transpose(1, 2))
        pen = f.float().pow(2).mean()
        x = self.in_proj(f)
        x = torch.where(mask[..., None], self.mask_emb.to(x.dtype), x)
        x = x + F.gelu(self.pos(x.transpose(1, 2))[..., :-1].transpose(1, 2))
        x = self.enc(x, src_key_padding_mask=pad_mask)
        c = self.out_proj(x)
        q, ppl = self.quantizer(f)
        q = self.q_proj(q.to(c.dtype))
        # negatives drawn from unpadded frames of the same utterance
        B, T, D = q.shape
        lens = (~pad_mask).sum(1)
        rnd = torch.rand(B, T, self.cfg.negatives, device=q.device)
        idx = (rnd * (lens - 1).clamp(min=1)[:, None, None]).long()
        idx = idx + (idx >= torch.arange(T, device=q.device)[None, :, None]).long()
        idx = idx.clamp(max=T - 1) + (torch.arange(B, device=q.device) * T)[:, None, None]
        negs = q.reshape(B * T, D)[idx.view(-1)].view(B, T, -1, D)
        cands = torch.cat([q.unsqueeze(2), negs], 2).float()
        logits = F.cosine_similarity(c.unsqueeze(2).float(), cands, dim=-1) / self.cfg.logit_temp
        sel = mask & ~pad_mask
        return logits[sel], ppl, pen


def load_tsv(path, min_len, max_len):
    with open(path) as f:
        root = f.readline().strip()
        rows = [l.split("\t") for l in f.read().splitlines()]
    return [(os.path.join(root, p), min(int(n), max_len)) for p, n in rows if int(n) >= min_len]


def make_batches(items, max_tokens, seed, epoch):
    """Length-sorted token-budget batches, shuffled identically on every rank."""
    order = sorted(range(len(items)), key=lambda i: items[i][1])
    batches, cur, cur_max = [], [], 0
    for i in order:
        n = items[i][1]
        if cur and max(cur_max, n) * (len(cur) + 1) > max_tokens:
            batches.append(cur)
            cur, cur_max = [], 0
        cur.append(i)
        cur_max = max(cur_max, n)
    if cur:
        batches.append(cur)
    rng = random.Random(seed + epoch)
    rng.shuffle(batches)
    return batches


def load_batch(items, idxs, max_len):
    wavs = []
    for i in idxs:
        w, _ = sf.read(items[i][0], dtype="float32")
        if len(w) > max_len:
            s = random.randint(0, len(w) - max_len)
            w = w[s:s + max_len]
        w = (w - w.mean()) / (w.std() + 1e-5)
        wavs.append(torch.from_numpy(w))
    L = max(w.numel() for w in wavs)
    out = torch.zeros(len(wavs), L)
    lens = torch.tensor([w.numel() for w in wavs])
    for j, w in enumerate(wavs):
        out[j, :w.numel()] = w
    return out, lens


def frame_masks(lens, conv, T, prob, span):
    flens = torch.tensor([out_frames(int(n), conv) for n in lens])
    pad = torch.arange(T)[None] >= flens[:, None]
    mask = torch.zeros(len(lens), T, dtype=torch.bool)
    for b, fl in enumerate(flens.tolist()):
        k = int(prob * fl / span + random.random())
        for s in np.random.choice(max(1, fl - span), min(k, max(1, fl - span)), replace=False):
            mask[b, s:s + span] = True
    return pad, mask & ~pad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--save-dir", default="checkpoints/w2v2_tok")
    ap.add_argument("--max-tokens", type=int, default=1_400_000)
    ap.add_argument("--max-sample-size", type=int, default=250_000)
    ap.add_argument("--min-sample-size", type=int, default=32_000)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=int, default=32_000)
    ap.add_argument("--max-update", type=int, default=400_000)
    ap.add_argument("--mask-prob", type=float, default=0.65)
    ap.add_argument("--mask-len", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--log-every", type=int, default=100)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR)
    torch.manual_seed(args.seed)

    cfg = ModelCfg()
    model = DistributedDataParallel(W2V2(cfg).to(dev), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.max_update,
                                                pct_start=args.warmup / args.max_update, anneal_strategy="linear")

    train = load_tsv(os.path.join(args.data, "train.tsv"), args.min_sample_size, args.max_sample_size)
    valid = load_tsv(os.path.join(args.data, "valid.tsv"), args.min_sample_size, args.max_sample_size)
    log.info("train %d utts, valid %d utts, world %d", len(train), len(valid), world)

    step, epoch = 0, 0
    while step < args.max_update:
        epoch += 1
        batches = make_batches(train, args.max_tokens, args.seed, epoch)
        my_batches = batches[rank::world]
        model.train()
        t0 = time.time()
        for idxs in my_batches:
            wav, lens = load_batch(train, idxs, args.max_sample_size)
            T = out_frames(wav.size(1), cfg.conv)
            pad, mask = frame_masks(lens, cfg.conv, T, args.mask_prob, args.mask_len)
            wav, pad, mask = wav.to(dev), pad.to(dev), mask.to(dev)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, ppl, pen = model(wav, pad, mask)
            nv = cfg.groups * cfg.vars
            loss = F.cross_entropy(logits, torch.zeros(len(logits), dtype=torch.long, device=dev))
            loss = loss + 0.1 * (nv - ppl) / nv + 10 * pen
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            sched.step()
            model.module.quantizer.tau = max(0.5, 2.0 * 0.999995 ** step)
            step += 1
            if step % args.log_every == 0 and rank == 0:
                log.info("ep %d step %d loss %.3f ppl %.1f lr %.2e (%.2fs/it)", epoch, step, loss.item(),
                         ppl.item(), sched.get_last_lr()[0], (time.time() - t0) / args.log_every)
                t0 = time.time()
            if step >= args.max_update:
                break

        # validation: each rank scores its own share, totals are reduced
        model.eval()
        tot = torch.zeros(3, device=dev)
        with torch.no_grad():
            for idxs in make_batches(valid, args.max_tokens, 0, 0)[rank::world]:
                wav, lens = load_batch(valid, idxs, args.max_sample_size)
                T = out_frames(wav.size(1), cfg.conv)
                pad, mask = frame_masks(lens, cfg.conv, T, args.mask_prob, args.mask_len)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits, _, _ = model.module(wav.to(dev), pad.to(dev), mask.to(dev))
                tot[0] += F.cross_entropy(logits, torch.zeros(len(logits), dtype=torch.long, device=dev),
                                          reduction="sum")
                tot[1] += (logits.argmax(-1) == 0).sum()
                tot[2] += len(logits)
        dist.all_reduce(tot)
        if rank == 0:
            log.info("epoch %d valid loss %.4f acc %.4f", epoch, (tot[0] / tot[2]).item(), (tot[1] / tot[2]).item())
            os.makedirs(args.save_dir, exist_ok=True)
            torch.save({"cfg": cfg.__dict__, "model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "step": step, "epoch": epoch},
                       os.path.join(args.save_dir, "checkpoint_last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
