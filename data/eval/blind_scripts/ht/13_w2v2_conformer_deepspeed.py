#!/usr/bin/env python
# wav2vec 2.0 Conformer-Large pretraining with DeepSpeed ZeRO stage 3.
#
#   deepspeed --hostfile /shared/hostfile --num_nodes 2 --num_gpus 8 13_w2v2_conformer_deepspeed.py \
#       --data /shared/data/vp100k --out /shared/exp/w2v2_conformer_l --ds-config ds_zero3.json
#
# ds_zero3.json (kept next to the recipe):
#   {"train_micro_batch_size_per_gpu": 6, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
#    "bf16": {"enabled": true},
#    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.98], "eps": 1e-6, "weight_decay": 0.01}},
#    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-4,
#                  "warmup_num_steps": 32000, "total_num_steps": 600000}},
#    "zero_optimization": {"stage": 3, "overlap_comm": true, "stage3_gather_16bit_weights_on_model_save": true}}
import argparse
import json
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


def frames(n):
    for _, k, s in CONV:
        n = (n - k) // s + 1
    return n


class ConvModule(nn.Module):
    def __init__(self, d, k=31):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.pw1 = nn.Conv1d(d, 2 * d, 1)
        self.dw = nn.Conv1d(d, d, k, padding=k // 2, groups=d)
        self.norm = nn.GroupNorm(1, d)
        self.pw2 = nn.Conv1d(d, d, 1)

    def forward(self, x):
        y = F.glu(self.pw1(self.ln(x).transpose(1, 2)), dim=1)
        y = self.pw2(F.silu(self.norm(self.dw(y))))
        return x + y.transpose(1, 2)


class ConformerBlock(nn.Module):
    def __init__(self, d, h, ffn, p=0.1):
        super().__init__()
        self.ff1 = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, ffn), nn.SiLU(), nn.Dropout(p), nn.Linear(ffn, d))
        self.attn_ln = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, h, dropout=p, batch_first=True)
        self.conv = ConvModule(d)
        self.ff2 = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, ffn), nn.SiLU(), nn.Dropout(p), nn.Linear(ffn, d))
        self.out_ln = nn.LayerNorm(d)

    def forward(self, x, pad):
        x = x + 0.5 * self.ff1(x)
        y = self.attn_ln(x)
        x = x + self.attn(y, y, y, key_padding_mask=pad, need_weights=False)[0]
        x = self.conv(x)
        x = x + 0.5 * self.ff2(x)
        return self.out_ln(x)


class GumbelVQ(nn.Module):
    def __init__(self, in_dim, G=2, V=320, out_dim=768):
        super().__init__()
        self.G, self.V = G, V
        self.weight_proj = nn.Linear(in_dim, G * V)
        self.codevectors = nn.Parameter(torch.empty(G * V, out_dim // G).uniform_())
        self.tau = 2.0

    def forward(self, x):
        B, T, _ = x.shape
        lg = self.weight_proj(x).float().view(B * T, self.G, self.V)
        avg = lg.softmax(-1).mean(0)
        ppl = torch.exp(-(avg * (avg + 1e-7).log()).sum(-1)).sum()
        oh = F.gumbel_softmax(lg, tau=self.tau, hard=True) if self.training else F.one_hot(lg.argmax(-1), self.V).float()
        q = torch.einsum("ngv,gvd->ngd", oh, self.codevectors.float().view(self.G, self.V, -1))
        return q.reshape(B, T, -1).to(x.dtype), ppl


class W2V2Conformer(nn.Module):
    def __init__(self, d=1024, depth=24, heads=16, ffn=4096, final_dim=768, n_neg=100):
        super().__init__()
        cnn, c_in = [], 1
        for i, (c, k, s) in enumerate(CONV):
            cnn += [nn.Conv1d(c_in, c, k, s, bias=False)] + ([nn.GroupNorm(c, c)] if i == 0 else []) + [nn.GELU()]
            c_in = c
        self.cnn = nn.Sequential(*cnn)
        self.cnn_ln = nn.LayerNorm(512)
        self.proj = nn.Linear(512, d)
        self.mask_emb = nn.Parameter(torch.empty(d).uniform_())
        self.blocks = nn.ModuleList([ConformerBlock(d, heads, ffn) for _ in range(depth)])
        self.final_proj = nn.Linear(d, final_dim)
        self.quantizer = GumbelVQ(512, out_dim=final_dim)
        self.project_q = nn.Linear(final_dim, final_dim)
        self.n_neg = n_neg

    def forward(self, wav, pad, mask):
        f = self.cnn_ln(self.cnn(wav[:, None]).transpose(1, 2))
        pen = f.float().pow(2).mean()
        x = torch.where(mask[..., None], self.mask_emb.to(f.dtype), self.proj(f))
        for blk in self.blocks:
            x = blk(x, pad)
        c = self.final_proj(x)
        q, ppl = self.quantizer(f)
        q = self.project_q(q)
        B, T, D = q.shape
        with torch.no_grad():
            n_valid = (~pad).sum(1)
            ni = (torch.rand(B, T, self.n_neg, device=q.device) * (n_valid - 1)[:, None, None]).long()
            ni += (ni >= torch.arange(T, device=q.device)[None, :, None]).long()
            ni += (torch.arange(B, device=q.device) * T)[:, None, None]
        negs = q.reshape(B * T, D)[ni.view(-1)].view(B, T, self.n_neg, D)
        logits = F.cosine_similarity(c.float()[:, :, None], torch.cat([q[:, :, None], negs], 2).float(), -1) / 0.1
        return logits[mask & ~pad], ppl, pen


class Corpus(Dataset):
    def __init__(self, tsv, max_len=320000, min_len=32000):
        with open(tsv) as f:
            root = f.readline().strip()
            self.items = [os.path.join(root, p) for p, n in (l.split("\t") for l in f.read().splitlines())
                          if int(n) >= min_len]
        self.max_len = max_len

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        w, _ = sf.read(self.items[i], dtype="float32")
        if len(w) > self.max_len:
            s = random.randint(0, len(w) - self.max_len)
            w = w[s:s + self.max_len]
        return torch.from_numpy((w - w.mean()) / (w.std() + 1e-6))


def collate(batch, p=0.65, L=10):
    n = max(len(w) for w in batch)
    wav = torch.zeros(len(batch), n)
    for i, w in enumerate(batch):
        wav[i, :len(w)] = w
    fl = torch.tensor([frames(len(w)) for w in batch])
    T = frames(n)
    pad = torch.arange(T)[None] >= fl[:, None]
    mask = torch.zeros(len(batch), T, dtype=torch.bool)
    for i, t in enumerate(fl.tolist()):
        for s in random.sample(range(t - L), min(int(p * t / L + random.random()), t - L)):
            mask[i, s:s + L] = True
    return wav, pad, mask


def codebook_usage(engine):
    """Mean pairwise cosine similarity between code vectors of each group (collapse monitor).
    Under ZeRO-3 the parameter is partitioned, so gather it on every rank first."""
    vq = engine.module.quantizer
    with deepspeed.zero.GatheredParameters([vq.codevectors], modifier_rank=None):
        cv = vq.codevectors.detach().float().clone()
    cv = F.normalize(cv.view(vq.G, vq.V, -1), dim=-1)
    sim = cv @ cv.transpose(1, 2)
    off = sim.sum() - sim.diagonal(dim1=1, dim2=2).sum()
    return (off / (vq.G * vq.V * (vq.V - 1))).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--ds-config", required=True)
    ap.add_argument("--max-steps", type=int, default=600000)
    ap.add_argument("--save-every", type=int, default=20000)
    ap.add_argument("--local_rank", type=int, default=-1)  # filled in by the deepspeed launcher
    args = ap.parse_args()

    ds_cfg = json.load(open(args.ds_config))
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    model = W2V2Conformer()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_cfg)
    dev = engine.device
    mb = engine.train_micro_batch_size_per_gpu()

    train, valid = Corpus(os.path.join(args.data, "train.tsv")), Corpus(os.path.join(args.data, "valid.tsv"))
    tsamp = DistributedSampler(train, world, rank, shuffle=True, seed=3, drop_last=True)
    # ZeRO-3 forward is collective: every rank must run the same number of eval batches
    vsamp = DistributedSampler(valid, world, rank, shuffle=False, drop_last=True)
    tl = DataLoader(train, mb, sampler=tsamp, collate_fn=collate, num_workers=8, pin_memory=True, drop_last=True)
    vl = DataLoader(valid, mb, sampler=vsamp, collate_fn=collate, num_workers=2)

    step, epoch = 0, 0
    if os.path.exists(os.path.join(args.out, "latest")):
        _, client = engine.load_checkpoint(args.out)
        step, epoch = client["step"], client["epoch"]
    nv = engine.module.quantizer.G * engine.module.quantizer.V

    while step < args.max_steps:
        tsamp.set_epoch(epoch)
        engine.train()
        tic = time.time()
        for wav, pad, mask in tl:
            logits, ppl, pen = engine(wav.to(dev, torch.bfloat16), pad.to(dev), mask.to(dev))
            loss = F.cross_entropy(logits, torch.zeros(len(logits), dtype=torch.long, device=dev))
            loss = loss + 0.1 * (nv - ppl) / nv + 10 * pen
            engine.backward(loss)
            engine.step()
            if not engine.is_gradient_accumulation_boundary():
                continue
            step += 1
            engine.module.quantizer.tau = max(0.1, 2.0 * 0.999995 ** step)
            if step % 1000 == 0:
                stats = torch.stack([loss.detach().float(), ppl.detach().float()])
                dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                sim = codebook_usage(engine)
                if rank == 0:
                    print(f"step {step} loss {stats[0]:.4f} ppl {stats[1]:.1f} cb_sim {sim:.4f} "
                          f"lr {engine.get_lr()[0]:.2e} {(time.time() - tic) / 1000:.2f}s/step", flush=True)
                    tic = time.time()
            if step % args.save_every == 0:
                # every rank writes its own ZeRO partition
                engine.save_checkpoint(args.out, tag=f"step_{step}", client_state={"step": step, "epoch": epoch})
            if step >= args.max_steps:
                break
        epoch += 1

        engine.eval()
        tot = torch.zeros(3, device=dev)
        with torch.no_grad():
            for wav, pad, mask in vl:
                logits, _, _ = engine(wav.to(dev, torch.bfloat16), pad.to(dev), mask.to(dev))
                tot += torch.stack([F.cross_entropy(logits, torch.zeros(len(logits), dtype=torch.long, device=dev),
                                                    reduction="sum"),
                                    (logits.argmax(-1) == 0).sum().float(),
                                    torch.tensor(float(len(logits)), device=dev)])
        dist.all_reduce(tot)
        if rank == 0:
            print(f"epoch {epoch} valid loss {tot[0] / tot[2]:.4f} acc {tot[1] / tot[2]:.4f}", flush=True)

    engine.save_checkpoint(args.out, tag="final", client_state={"step": step, "epoch": epoch})
    # consolidated bf16 weights for fine-tuning (needs all ranks: parameters are gathered)
    engine.save_16bit_model(os.path.join(args.out, "final_16bit"), "pytorch_model.bin")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
