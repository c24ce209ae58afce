"""Coarse-stage AR model (VALL-E style, music): predicts the first RVQ codebook of
EnCodec-32kHz tokens, conditioned on a bag of style tags (genre / mood / instrument).

Expected layout
    <data>/tags.json                 {"tag_name": id, ...}
    <data>/{train,valid}.jsonl       {"codes": "xxx.npy", "tags": ["rock", "guitar", ...]}

    torchrun --nproc_per_node=8 13_coarse_ar_style_tags.py --data /shared/mtg_jamendo_encodec --ckpt_dir /shared/ckpt/coarse_ar
"""
import argparse
import glob
import json
import math
import os
import re
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

CARD = 2048
BOS, EOS, PAD = CARD, CARD + 1, CARD + 2
VOCAB = CARD + 3
MAX_TAGS = 8


class CoarseCodes(Dataset):
    def __init__(self, manifest, root, tag2id, frames, train):
        with open(manifest) as f:
            self.items = [json.loads(l) for l in f]
        self.root, self.tag2id, self.frames, self.train = root, tag2id, frames, train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        c0 = np.load(os.path.join(self.root, it["codes"]), mmap_mode="r")[0]
        if len(c0) > self.frames:
            s = np.random.randint(0, len(c0) - self.frames + 1) if self.train else 0
            seq = [BOS] + c0[s:s + self.frames].tolist()
        else:
            seq = [BOS] + c0.tolist() + [EOS]
        x = torch.full((self.frames + 2,), PAD, dtype=torch.long)
        x[:len(seq)] = torch.tensor(seq)
        tags = [self.tag2id[t] + 1 for t in it["tags"] if t in self.tag2id][:MAX_TAGS]
        tag_ids = torch.zeros(MAX_TAGS, dtype=torch.long)  # 0 = no tag
        tag_ids[:len(tags)] = torch.tensor(tags, dtype=torch.long)
        return x, tag_ids


class CoarseAR(nn.Module):
    def __init__(self, n_tags, dim=1024, depth=12, heads=16, max_len=1536):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, dim)
        self.tag = nn.EmbeddingBag(n_tags + 1, dim, mode="sum", padding_idx=0)
        self.pos = nn.Embedding(max_len, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, 0.1, batch_first=True, norm_first=True,
                                           activation="gelu")
        self.body = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, x, tag_ids):
        T = x.size(1)
        h = self.tok(x) + self.pos(torch.arange(T, device=x.device)) + self.tag(tag_ids)[:, None]
        mask = nn.Transformer.generate_square_subsequent_mask(T, device=x.device)
        return self.head(self.norm(self.body(h, mask=mask, is_causal=True)))


def save_checkpoint(ckpt_dir, model, opt, sched, step, keep=3):
    os.makedirs(ckpt_dir, exist_ok=True)
    state = {"model": model.module.state_dict(), "opt": opt.state_dict(),
             "sched": sched.state_dict(), "step": step}
    path = os.path.join(ckpt_dir, f"step_{step:08d}.pt")
    torch.save(state, path)
    # rotate old checkpoints
    ckpts = sorted(glob.glob(os.path.join(ckpt_dir, "step_*.pt")))
    for old in ckpts[:-keep]:
        os.remove(old)


def latest_checkpoint(ckpt_dir):
    ckpts = sorted(glob.glob(os.path.join(ckpt_dir, "step_*.pt")),
                   key=lambda p: int(re.findall(r"step_(\d+)", p)[0]))
    return ckpts[-1] if ckpts else None


@torch.no_grad()
def valid_loss(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device, dtype=torch.float64)
    for x, tags in loader:
        x, tags = x.to(device), tags.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x[:, :-1], tags)
        acc[0] += F.cross_entropy(logits.float().transpose(1, 2), x[:, 1:], ignore_index=PAD, reduction="sum")
        acc[1] += (x[:, 1:] != PAD).sum()
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--ckpt_dir", required=True)
    ap.add_argument("--frames", type=int, default=1500, help="30 s at 50 Hz")
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=4000)
    ap.add_argument("--max_steps", type=int, default=300_000)
    ap.add_argument("--save_every", type=int, default=2000)
    ap.add_argument("--eval_every", type=int, default=2000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    with open(os.path.join(args.data, "tags.json")) as f:
        tag2id = json.load(f)
    train_ds = CoarseCodes(os.path.join(args.data, "train.jsonl"), args.data, tag2id, args.frames, True)
    valid_ds = CoarseCodes(os.path.join(args.data, "valid.jsonl"), args.data, tag2id, args.frames, False)
    valid_ds.items = valid_ds.items[rank::world]
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=8, pin_memory=True,
                          drop_last=True, persistent_workers=True)
    valid_dl = DataLoader(valid_ds, args.batch_size, num_workers=4)

    model = CoarseAR(len(tag2id), max_len=args.frames + 2).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.max_steps))))

    step = 0
    last = latest_checkpoint(args.ckpt_dir)
    if last is not None:
        ck = torch.load(last, map_location="cpu")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        step = ck["step"]
        if rank == 0:
            print(f"resumed from {last} (step {step})", flush=True)
    model = DDP(model, device_ids=[local_rank])

    epoch = step // len(train_dl)
    t0 = time.time()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for x, tags in train_dl:
            x, tags = x.to(device, non_blocking=True), tags.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x[:, :-1], tags)
            loss = F.cross_entropy(logits.float().transpose(1, 2), x[:, 1:], ignore_index=PAD)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1

            if rank == 0 and step % 100 == 0:
                print(f"step {step} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                      f"{(time.time() - t0) / 100:.3f}s/it", flush=True)
                t0 = time.time()
            if step % args.eval_every == 0:
                v = valid_loss(model.module, valid_dl, device)
                if rank == 0:
                    print(f"step {step} valid loss {v:.4f}", flush=True)
            if step % args.save_every == 0:
                save_checkpoint(args.ckpt_dir, model, opt, sched, step)
            if step >= args.max_steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
