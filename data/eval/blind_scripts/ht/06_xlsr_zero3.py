#!/usr/bin/env python
# XLS-R style (300M, pre-LN) wav2vec 2.0 pretraining on multilingual audio with DeepSpeed ZeRO-3.
#
#   deepspeed --hostfile hostfile --num_nodes 4 --num_gpus 8 06_xlsr_zero3.py \
#       --data /shared/mls_cv_babel --save-dir /shared/ckpt/xlsr300m
import argparse
import json
import math
import os
import random
import time

import deepspeed
import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler

CONV = [(512, 10, 5)] + [(512, 3, 2)] * 4 + [(512, 2, 2)] * 2


def n_out(n):
    for _, k, s in CONV:
        n = (n - k) // s + 1
    return n


class CodebookQuantizer(nn.Module):
    def __init__(self, in_dim, G=2, V=320, dim=768):
        super().__init__()
        self.G, self.V = G, V
        self.weight_proj = nn.Linear(in_dim, G * V)
        self.codevectors = nn.Parameter(torch.empty(G * V, dim // G).uniform_())
        self.temp = 2.0

    def forward(self, x):
        B, T, _ = x.shape
        logits = self.weight_proj(x).float().view(B * T, self.G, self.V)
        avg = logits.softmax(-1).mean(0)
        ppl = torch.exp(-(avg * torch.log(avg + 1e-7)).sum(-1)).sum()
        if self.training:
            oh = F.gumbel_softmax(logits, tau=self.temp, hard=True)
        else:
            oh = F.one_hot(logits.argmax(-1), self.V).float()
        cv = self.codevectors.float().view(self.G, self.V, -1)
        q = torch.einsum("ngv,gvd->ngd", oh, cv).reshape(B, T, -1)
        return q.to(x.dtype), ppl


class PreLNLayer(nn.Module):
    def __init__(self, d, h, ffn, p):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, h, dropout=p, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(d, ffn), nn.GELU(), nn.Dropout(p), nn.Linear(ffn, d))
        self.drop = nn.Dropout(p)

    def forward(self, x, pad):
        y = self.ln1(x)
        x = x + self.drop(self.attn(y, y, y, key_padding_mask=pad, need_weights=False)[0])
        return x + self.drop(self.ff(self.ln2(x)))


class XLSR(nn.Module):
    def __init__(self, d=1024, layers=24, heads=16, ffn=4096, final_dim=768, n_neg=100):
        super().__init__()
        conv, c_in = [], 1
        for c, k, s in CONV:
            conv += [nn.Conv1d(c_in, c, k, s, bias=True), nn.LayerNorm(c), nn.GELU()]
            c_in = c
        self.conv = nn.ModuleList(conv)
        self.feat_ln = nn.LayerNorm(512)
        self.proj = nn.Linear(512, d)
        self.mask_emb = nn.Parameter(torch.empty(d).uniform_())
        self.pos_conv = nn.Conv1d(d, d, 128, padding=64, groups=16)
        self.layers = nn.ModuleList([PreLNLayer(d, heads, ffn, 0.1) for _ in range(layers)])
        self.out_ln = nn.LayerNorm(d)
        self.final_proj = nn.Linear(d, final_dim)
        self.quantizer = CodebookQuantizer(512, dim=final_dim)
        self.project_q = nn.Linear(final_dim, final_dim)
        self.n_neg = n_neg

    def forward(self, wav, pad, mask):
        x = wav.unsqueeze(1)
        for m in self.conv:
            x = m(x.transpose(1, 2)).transpose(1, 2) if isinstance(m, nn.LayerNorm) else m(x)
        f = self.feat_ln(x.transpose(1, 2))
        pen = f.float().pow(2).mean()
        x = self.proj(f)
        x = torch.where(mask.unsqueeze(-1), self.mask_emb.to(x.dtype), x)
        x = x + F.gelu(self.pos_conv(x.transpose(1, 2))[..., :-1]).transpose(1, 2)
        for layer in self.layers:
            x = layer(x, pad)
        c = self.final_proj(self.out_ln(x))
        q, ppl = self.quantizer(f)
        q = self.project_q(q)
        B, T, D = q.shape
        with torch.no_grad():
            valid = (~pad).sum(1, keepdim=True)
            neg = (torch.rand(B, T * self.n_neg, device=q.device) * (valid - 1)).long()
            neg = neg + (neg >= torch.arange(T, device=q.device).repeat_interleave(self.n_neg)).long()
            neg = neg + torch.arange(B, device=q.device)[:, None] * T
        negs = q.reshape(B * T, D)[neg.view(-1)].view(B, T, self.n_neg, D)
        cand = torch.cat([q.unsqueeze(2), negs], 2)
        logits = F.cosine_similarity(c.float().unsqueeze(2), cand.float(), dim=-1) / 0.1
        return logits[mask & ~pad], ppl, pen


class MultilingualAudio(Dataset):
    def __init__(self, manifest, max_len=320000, min_len=32000):
        with open(manifest) as f:
            root = f.readline().strip()
            self.rows = [(os.path.join(root, p), int(n)) for p, n in (l.split("\t") for l in f.read().splitlines())
                         if int(n) >= min_len]
        self.max_len = max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        w, _ = sf.read(self.rows[i][0], dtype="float32")
        if len(w) > self.max_len:
            s = np.random.randint(0, len(w) - self.max_len)
            w = w[s:s + self.max_len]
        return torch.from_numpy((w - w.mean()) / (w.std() + 1e-7))


def pad_collate(batch, mask_prob=0.65, span=10):
    L = max(b.numel() for b in batch)
    wav = torch.zeros(len(batch), L)
    for i, b in enumerate(batch):
        wav[i, :b.numel()] = b
    T = n_out(L)
    lens = torch.tensor([n_out(b.numel()) for b in batch])
    pad = torch.arange(T)[None] >= lens[:, None]
    mask = torch.zeros(len(batch), T, dtype=torch.bool)
    for i, fl in enumerate(lens.tolist()):
        k = min(int(mask_prob * fl / span + np.random.rand()), fl - span)
        for s in np.random.choice(fl - span, k, replace=False):
            mask[i, s:s + span] = True
    return wav, pad, mask & ~pad


def ds_config(args):
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.98], "eps": 1e-6,
                                                  "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": args.lr,
                                                          "warmup_num_steps": args.warmup,
                                                          "total_num_steps": args.max_steps}},
        "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                              "stage3_gather_16bit_weights_on_model_save": False},
        "steps_per_print": 1000,
        "wall_clock_breakdown": False,
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-4)  # tuned for 32 GPUs x 4 x 2 utterances
    p.add_argument("--warmup", type=int, default=32000)
    p.add_argument("--max-steps", type=int, default=1000000)
    p.add_argument("--log-every", type=int, default=500)
    p.add_argument("--codebook-stats-every", type=int, default=5000)
    p.add_argument("--local_rank", type=int, default=-1)
    args = p.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed(dist_backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    model = XLSR()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(args))
    dev = engine.device

    train = MultilingualAudio(os.path.join(args.data, "train.tsv"))
    valid = MultilingualAudio(os.path.join(args.data, "valid.tsv"))
    tsamp = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=17)
    vsamp = DistributedSampler(valid, num_replicas=world, rank=rank, shuffle=False, drop_last=True)
    tl = DataLoader(train, batch_size=args.micro_batch, sampler=tsamp, collate_fn=pad_collate, num_workers=8,
                    pin_memory=True, drop_last=True)
    vl = DataLoader(valid, batch_size=args.micro_batch, sampler=vsamp, collate_fn=pad_collate, num_workers=4)

    _, client = engine.load_checkpoint(args.save_dir) if os.path.isdir(args.save_dir) else (None, None)
    step = client["step"] if client else 0
    epoch = client["epoch"] if client else 0
    NV = engine.module.quantizer.G * engine.module.quantizer.V

    t0 = time.time()
    while step < args.max_steps:
        tsamp.set_epoch(epoch)
        engine.train()
        for wav, pad, mask in tl:
            wav, pad, mask = wav.to(dev), pad.to(dev), mask.to(dev)
            logits, ppl, pen = engine(wav.to(torch.bfloat16), pad, mask)
            loss = F.cross_entropy(logits, torch.zeros(len(logits), dtype=torch.long, device=dev))
            loss = loss + 0.1 * (NV - ppl) / NV + 10.0 * pen
            engine.backward(loss)
            engine.step()
            if not engine.is_gradient_accumulation_boundary():
                continue
            step += 1
            engine.module.quantizer.temp = max(0.1, 2.0 * 0.999995 ** step)

            if step % args.log_every == 0:
                s = torch.stack([loss.detach().float(), ppl.detach().float()])
                dist.all_reduce(s, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"[{step}] loss={s[0]:.4f} prob_ppl={s[1]:.1f} lr={engine.get_lr()[0]:.2e} "
                          f"{(time.time() - t0) / args.log_every:.2f}s/step", flush=True)
                    t0 = time.time()
            if step % args.codebook_stats_every == 0:
                with torch.no_grad():
                    cv = engine.module.quantizer.codevectors.detach().float().view(NV // 320, 320, -1)
                    cv = F.normalize(cv, dim=-1)
                    sim = torch.einsum("gvd,gwd->gvw", cv, cv)
                    offdiag = (sim.sum() - sim.diagonal(dim1=1, dim2=2).sum()) / (NV * 319)
                if rank == 0:
                    print(f"[{step}] codebook mean off-diagonal cosine {offdiag.item():.4f}", flush=True)
            if step % 25000 == 0:
                engine.save_checkpoint(args.save_dir, tag=f"step{step}", client_state={"step": step, "epoch": epoch})
            if step >= args.max_steps:
                break
        epoch += 1

        engine.eval()
        acc = torch.zeros(3, device=dev)
        with torch.no_grad():
            for wav, pad, mask in vl:
                logits, _, _ = engine(wav.to(dev, torch.bfloat16), pad.to(dev), mask.to(dev))
                acc[0] += F.cross_entropy(logits, torch.zeros(len(logits), dtype=torch.long, device=dev),
                                          reduction="sum")
                acc[1] += (logits.argmax(-1) == 0).sum()
                acc[2] += len(logits)
        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch} valid loss {acc[0] / acc[2]:.4f} acc {acc[1] / acc[2]:.4f}", flush=True)

    engine.save_checkpoint(args.save_dir, tag="last", client_state={"step": step, "epoch": epoch})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
