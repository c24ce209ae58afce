"""VideoMAE self-supervised pre-training (tube masking, ratio 0.9) on Something-Something V2.

Encoder ViT-B/16 (tubelet 2x16x16, 16 frames), 4-layer decoder that reconstructs the
normalised pixels of the masked tubes. Activation checkpointing of the encoder blocks is
enabled with --use-checkpoint to fit batch 32 per GPU on 40 GB cards.

    torchrun --nproc_per_node=8 16_videomae_pretrain_ssv2.py --data-path ssv2/train.csv \
        --use-checkpoint --batch-size 32 --epochs 800
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
import torch.utils.checkpoint as cp
from decord import VideoReader, cpu
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class Block(nn.Module):
    def __init__(self, dim, heads, mlp_ratio=4.0):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, int(dim * mlp_ratio)), nn.GELU(), nn.Linear(int(dim * mlp_ratio), dim))
        self.heads = heads

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c))
        return x + self.mlp(self.norm2(x))


def sincos_table(n, dim):
    pos = np.arange(n)[:, None] / np.power(10000, 2 * (np.arange(dim)[None] // 2) / dim)
    pos[:, 0::2], pos[:, 1::2] = np.sin(pos[:, 0::2]), np.cos(pos[:, 1::2])
    return torch.from_numpy(pos).float()[None]


class Encoder(nn.Module):
    def __init__(self, dim=768, depth=12, heads=12, frames=16, tubelet=2, patch=16, img=224,
                 num_classes=174, use_checkpoint=False):
        super().__init__()
        self.patch_embed = nn.Conv3d(3, dim, (tubelet, patch, patch), (tubelet, patch, patch))
        self.num_patches = (frames // tubelet) * (img // patch) ** 2
        self.register_buffer("pos_embed", sincos_table(self.num_patches, dim), persistent=False)
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)  # kept so the same weights load for fine-tuning
        self.use_checkpoint = use_checkpoint

    def forward(self, x, mask):
        x = self.patch_embed(x).flatten(2).transpose(1, 2) + self.pos_embed
        b, _, c = x.shape
        x = x[~mask].reshape(b, -1, c)              # visible tokens only
        for blk in self.blocks:
            if self.use_checkpoint:
                x = cp.checkpoint(blk, x)
            else:
                x = blk(x)
        return self.norm(x)


class VideoMAE(nn.Module):
    def __init__(self, use_checkpoint=False, dec_dim=384, dec_depth=4, patch=16, tubelet=2):
        super().__init__()
        self.encoder = Encoder(use_checkpoint=use_checkpoint)
        self.enc_to_dec = nn.Linear(768, dec_dim, bias=False)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dec_dim))
        self.register_buffer("dec_pos", sincos_table(self.encoder.num_patches, dec_dim), persistent=False)
        self.decoder = nn.ModuleList([Block(dec_dim, 6) for _ in range(dec_depth)])
        self.dec_norm = nn.LayerNorm(dec_dim)
        self.dec_head = nn.Linear(dec_dim, 3 * tubelet * patch * patch)
        nn.init.trunc_normal_(self.mask_token, std=0.02)

    def forward(self, x, mask):
        z = self.enc_to_dec(self.encoder(x, mask))
        b, _, c = z.shape
        pos = self.dec_pos.expand(b, -1, -1)
        vis = torch.cat([z + pos[~mask].reshape(b, -1, c),
                         self.mask_token + pos[mask].reshape(b, -1, c)], dim=1)
        for blk in self.decoder:
            vis = blk(vis)
        n_mask = int(mask[0].sum())
        return self.dec_head(self.dec_norm(vis[:, -n_mask:]))


def tube_mask(batch, frames=8, hw=196, ratio=0.9):
    keep = hw - int(hw * ratio)
    m = np.ones((batch, hw), dtype=bool)
    for i in range(batch):
        m[i, np.random.permutation(hw)[:keep]] = False
    return torch.from_numpy(np.repeat(m[:, None], frames, axis=1).reshape(batch, -1))


def patchify_target(video, tubelet=2, p=16):
    # video: B C T H W (normalised), returns per-patch normalised pixels, B N (t p p c)
    b, c, t, h, w = video.shape
    x = video.view(b, c, t // tubelet, tubelet, h // p, p, w // p, p)
    x = x.permute(0, 2, 4, 6, 3, 5, 7, 1).reshape(b, -1, tubelet * p * p, c)
    x = (x - x.mean(-2, keepdim=True)) / (x.var(-2, unbiased=True, keepdim=True).sqrt() + 1e-6)
    return x.flatten(2)


class SSV2Pretrain(Dataset):
    def __init__(self, csv_path, frames=16, rate=2):
        with open(csv_path) as f:
            self.paths = [line.split()[0] for line in f if line.strip()]
        self.frames, self.rate = frames, rate
        self.mean = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1, 1)
        self.std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1, 1)

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        for _ in range(10):
            try:
                vr = VideoReader(self.paths[i], ctx=cpu(0), num_threads=1)
                break
            except Exception:
                i = np.random.randint(len(self.paths))
        n, span = len(vr), self.frames * self.rate
        st = np.random.randint(0, max(n - span, 0) + 1)
        x = torch.from_numpy(vr.get_batch(np.minimum(np.arange(st, st + span, self.rate), n - 1)).asnumpy())
        x = x.permute(3, 0, 1, 2).float() / 255.0
        scale = np.random.uniform(0.66, 1.0)
        h, w = x.shape[-2:]
        ch, cw = int(h * scale), int(w * scale)
        y0, x0 = np.random.randint(0, h - ch + 1), np.random.randint(0, w - cw + 1)
        x = F.interpolate(x[..., y0:y0 + ch, x0:x0 + cw], size=(224, 224), mode="bilinear", align_corners=False)
        return (x - self.mean) / self.std


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-path", required=True)
    ap.add_argument("--output-dir", default="output/videomae_ssv2_pretrain")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=800)
    ap.add_argument("--warmup-epochs", type=int, default=40)
    ap.add_argument("--blr", type=float, default=1.5e-4)
    ap.add_argument("--mask-ratio", type=float, default=0.9)
    ap.add_argument("--use-checkpoint", action="store_true")
    ap.add_argument("--save-every", type=int, default=20)
    ap.add_argument("--workers", type=int, default=10)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    np.random.seed(rank + 17)

    dataset = SSV2Pretrain(args.data_path)
    sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = VideoMAE(use_checkpoint=args.use_checkpoint).to(device)
    # encoder.head is only used after fine-tuning starts
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    lr = args.blr * args.batch_size * world / 256
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.05)
    scaler = torch.cuda.amp.GradScaler()
    iters = len(loader)

    start_epoch = 0
    last = os.path.join(args.output_dir, "checkpoint-last.pth")
    if os.path.exists(last):
        ck = torch.load(last, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        scaler.load_state_dict(ck["scaler"])
        start_epoch = ck["epoch"] + 1

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, video in enumerate(loader):
            e = epoch + it / iters
            cur = lr * e / args.warmup_epochs if e < args.warmup_epochs else \
                lr * 0.5 * (1 + math.cos(math.pi * (e - args.warmup_epochs) / (args.epochs - args.warmup_epochs)))
            for g in optimizer.param_groups:
                g["lr"] = cur
            video = video.to(device, non_blocking=True)
            mask = tube_mask(video.shape[0], ratio=args.mask_ratio).to(device, non_blocking=True)
            with torch.no_grad():
                target = patchify_target(video)[mask].reshape(video.shape[0], -1, 3 * 2 * 16 * 16)
            with torch.autocast("cuda", dtype=torch.float16):
                pred = model(video, mask)
                loss = F.mse_loss(pred.float(), target)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if it % 50 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l)
                if rank == 0:
                    print(f"epoch {epoch} [{it}/{iters}] loss {l.item() / world:.4f} lr {cur:.2e} "
                          f"{(time.time() - t0) / (it + 1):.2f}s/it", flush=True)

        if rank == 0 and ((epoch + 1) % args.save_every == 0 or epoch + 1 == args.epochs):
            os.makedirs(args.output_dir, exist_ok=True)
            ck = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                  "scaler": scaler.state_dict(), "epoch": epoch}
            torch.save(ck, os.path.join(args.output_dir, f"checkpoint-{epoch}.pth"))
            torch.save(ck, last)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
