#!/usr/bin/env python
"""Encoder-decoder ASR (log-mel -> BPE) trained with DeepSpeed ZeRO-2.

Encoder layers use DeepSpeed activation checkpointing; the job is started with
torchrun on the cluster's 8-GPU nodes.

    torchrun --nproc_per_node 8 20_asr_encdec_torchrun.py \
        --manifest /shared/asr/train_manifest.jsonl --dev-manifest /shared/asr/dev_manifest.jsonl \
        --out /shared/exp/asr_large
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import deepspeed
import deepspeed.comm as dist
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--manifest", required=True)
    p.add_argument("--dev-manifest", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--n-mels", type=int, default=80)
    p.add_argument("--d", type=int, default=1280)
    p.add_argument("--enc-layers", type=int, default=32)
    p.add_argument("--dec-layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=20)
    p.add_argument("--vocab", type=int, default=51865)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=1.5e-4)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--local_rank", type=int, default=0)
    return p.parse_args()


class MelText(Dataset):
    def __init__(self, manifest):
        with open(manifest) as f:
            self.items = [json.loads(l) for l in f]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        mel = torch.from_numpy(np.load(it["mel_path"])).float()  # (n_mels, frames)
        tokens = torch.tensor([BOS_ID] + it["tokens"] + [EOS_ID])
        return mel, tokens


def collate(batch):
    mels, toks = zip(*batch)
    frames = max(m.size(1) for m in mels)
    frames += frames % 2
    mel = torch.stack([F.pad(m, (0, frames - m.size(1))) for m in mels])
    tok = pad_sequence(toks, batch_first=True, padding_value=PAD_ID)
    return mel, tok


class AudioEncoder(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.conv1 = nn.Conv1d(a.n_mels, a.d, 3, padding=1)
        self.conv2 = nn.Conv1d(a.d, a.d, 3, stride=2, padding=1)
        self.layers = nn.ModuleList([nn.TransformerEncoderLayer(a.d, a.heads, 4 * a.d, dropout=0.0,
                                                                 activation="gelu", batch_first=True, norm_first=True)
                                     for _ in range(a.enc_layers)])
        self.ln = nn.LayerNorm(a.d)

    def forward(self, mel):
        x = F.gelu(self.conv2(F.gelu(self.conv1(mel)))).transpose(1, 2)
        t = torch.arange(x.size(1), device=x.device, dtype=x.dtype)
        inv = torch.exp(-torch.arange(0, x.size(2), 2, device=x.device, dtype=x.dtype) * (9.21 / x.size(2)))
        pe = torch.cat([torch.sin(t[:, None] * inv), torch.cos(t[:, None] * inv)], -1)
        x = x + pe
        for layer in self.layers:
            x = deepspeed.checkpointing.checkpoint(layer, x)
        return self.ln(x)


class TextDecoder(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.tok = nn.Embedding(a.vocab, a.d, padding_idx=PAD_ID)
        self.pos = nn.Embedding(448, a.d)
        self.layers = nn.ModuleList([nn.TransformerDecoderLayer(a.d, a.heads, 4 * a.d, dropout=0.0,
                                                                 activation="gelu", batch_first=True, norm_first=True)
                                     for _ in range(a.dec_layers)])
        self.ln = nn.LayerNorm(a.d)

    def forward(self, tokens, memory):
        T = tokens.size(1)
        x = self.tok(tokens) + self.pos(torch.arange(T, device=tokens.device))
        causal = torch.ones(T, T, dtype=torch.bool, device=tokens.device).triu(1)
        for layer in self.layers:
            x = layer(x, memory, tgt_mask=causal, tgt_key_padding_mask=tokens == PAD_ID)
        return F.linear(self.ln(x), self.tok.weight)


class ASRModel(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.encoder = AudioEncoder(a)
        self.decoder = TextDecoder(a)

    def forward(self, mel, tokens):
        logits = self.decoder(tokens[:, :-1], self.encoder(mel))
        return F.cross_entropy(logits.float().transpose(1, 2), tokens[:, 1:], ignore_index=PAD_ID)


def main():
    args = get_args()
    torch.cuda.set_device(args.local_rank)
    device = torch.device("cuda", args.local_rank)
    deepspeed.init_distributed(dist_backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "train_batch_size": args.micro_batch * args.grad_accum * world,
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                              "allgather_bucket_size": 2e8, "reduce_bucket_size": 2e8},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.98], "eps": 1e-6,
                                                  "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": args.lr,
                                                     "warmup_num_steps": 2048}},
    }
    deepspeed.checkpointing.configure(None, deepspeed_config=ds_config)

    train_ds, dev_ds = MelText(args.manifest), MelText(args.dev_manifest)
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True)
    loader = DataLoader(train_ds, batch_size=args.micro_batch, sampler=sampler, collate_fn=collate,
                        num_workers=8, pin_memory=True, drop_last=True)
    dev_loader = DataLoader(dev_ds, batch_size=args.micro_batch, collate_fn=collate, num_workers=4,
                            sampler=DistributedSampler(dev_ds, num_replicas=world, rank=rank, shuffle=False,
                                                       drop_last=True))

    model = ASRModel(args)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    if os.path.exists(os.path.join(args.out, "latest")):
        engine.load_checkpoint(args.out)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for i, (mel, tok) in enumerate(loader):
            mel = mel.to(device, dtype=torch.bfloat16, non_blocking=True)
            tok = tok.to(device, non_blocking=True)
            loss = engine(mel, tok)
            engine.backward(loss)
            engine.step()
            if rank == 0 and i % 50 == 0:
                print(f"epoch {epoch} it {i} loss {loss.item():.4f} lr {engine.get_lr()[0]:.2e} "
                      f"{(time.time() - t0) / (i + 1):.2f}s/it", flush=True)

        engine.eval()
        agg = torch.zeros(2, device=device)
        with torch.no_grad():
            for mel, tok in dev_loader:
                agg[0] += engine(mel.to(device, dtype=torch.bfloat16), tok.to(device)).float()
                agg[1] += 1
        dist.all_reduce(agg)
        engine.train()
        if rank == 0:
            print(f"epoch {epoch} dev loss {(agg[0] / agg[1]).item():.4f}", flush=True)
        engine.save_checkpoint(args.out, tag=f"epoch{epoch}")

    dist.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
