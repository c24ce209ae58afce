"""Stage 2: class-conditional GPT over VQGAN codes (taming-transformers style, raster order).

Images are tokenized once with the frozen stage-1 VQGAN and cached as a uint16 array next to
the dataset so that later runs skip the (slow) encoding pass.

    torchrun --nproc_per_node=8 04_gpt_imagenet_stage2.py \
        --data /data/imagenet/train --vqgan ckpt/vqgan_f16_1024/last.ckpt --out runs/gpt_b
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
from tqdm import tqdm

from lab_tokenizers.vqgan import load_vqgan


class CodeDataset(Dataset):
    def __init__(self, codes, labels):
        self.codes = codes
        self.labels = labels

    def __len__(self):
        return len(self.codes)

    def __getitem__(self, i):
        return torch.from_numpy(self.codes[i].astype(np.int64)), int(self.labels[i])


@torch.no_grad()
def build_code_cache(args, device):
    cache = os.path.join(args.cache_dir, f"codes_{os.path.basename(args.vqgan_tag)}_{args.resolution}.npz")
    if os.path.exists(cache):
        d = np.load(cache)
        return d["codes"], d["labels"]

    vqgan = load_vqgan(args.vqgan).to(device).eval()
    tf = transforms.Compose([transforms.Resize(args.resolution), transforms.CenterCrop(args.resolution),
                             transforms.ToTensor(), transforms.Normalize([0.5] * 3, [0.5] * 3)])
    ds = datasets.ImageFolder(args.data, transform=tf)
    dl = DataLoader(ds, batch_size=128, shuffle=False, num_workers=16, pin_memory=True)
    codes, labels = [], []
    for x, y in tqdm(dl, desc="tokenizing"):
        idx = vqgan.encode_to_indices(x.to(device))  # (B, h, w)
        codes.append(idx.flatten(1).cpu().numpy().astype(np.uint16))
        labels.append(y.numpy().astype(np.int16))
    codes, labels = np.concatenate(codes), np.concatenate(labels)
    os.makedirs(args.cache_dir, exist_ok=True)
    np.savez(cache, codes=codes, labels=labels)
    del vqgan
    torch.cuda.empty_cache()
    return codes, labels


class CausalSelfAttention(nn.Module):
    def __init__(self, dim, heads, drop):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.drop = drop

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.drop if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, dim, heads, drop):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, drop)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(drop))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ImageGPT(nn.Module):
    def __init__(self, vocab, n_cls, seq_len, dim=768, depth=12, heads=12, drop=0.1):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, dim)
        self.cls_emb = nn.Embedding(n_cls, dim)
        self.pos_emb = nn.Parameter(torch.zeros(1, seq_len, dim))
        self.blocks = nn.Sequential(*[Block(dim, heads, drop) for _ in range(depth)])
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, codes, y):
        # condition token replaces the first position; predict codes[0..T-1]
        x = torch.cat([self.cls_emb(y)[:, None], self.tok_emb(codes[:, :-1])], dim=1)
        x = self.blocks(x + self.pos_emb[:, : x.shape[1]])
        return self.head(self.ln_f(x))


def lr_at(step, warmup, total, base):
    if step < warmup:
        return base * step / warmup
    return base * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--vqgan", required=True)
    p.add_argument("--vqgan_tag", default="vqgan_f16_1024")
    p.add_argument("--cache_dir", default="/data/cache/tokens")
    p.add_argument("--out", required=True)
    p.add_argument("--resolution", type=int, default=256)
    p.add_argument("--codebook_size", type=int, default=1024)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--lr", type=float, default=4.5e-4)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5000)
    args = p.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    codes, labels = build_code_cache(args, device)
    seq_len = codes.shape[1]
    ds = CodeDataset(codes, labels)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)

    model = ImageGPT(args.codebook_size, 1000, seq_len).to(device)
    model = DDP(model, device_ids=[local_rank])
    decay = [p_ for n, p_ in model.named_parameters() if p_.dim() >= 2 and "emb" not in n]
    no_decay = [p_ for n, p_ in model.named_parameters() if p_.dim() < 2 or "emb" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    total = args.epochs * len(dl)
    scaler = torch.cuda.amp.GradScaler()

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y in dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            for g in opt.param_groups:
                g["lr"] = lr_at(step, args.warmup, total, args.lr)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(x, y)
                loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x.reshape(-1))
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            step += 1
            if step % 200 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} it {step}/{total} loss {l.item():.4f} "
                          f"lr {opt.param_groups[0]['lr']:.2e} {(time.time() - t0) / 200:.3f}s/it", flush=True)
                    t0 = time.time()
        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch,
                        "scaler": scaler.state_dict(), "args": vars(args)}, os.path.join(args.out, "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
