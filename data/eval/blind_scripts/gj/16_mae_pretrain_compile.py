"""MAE ViT-L/16 pretraining on ImageNet with per-block torch.compile and DDP.

The mask ratio is fixed (75%), so the encoder always sees exactly 49 visible
patches and the decoder 196 tokens: both compiled regions are static.

    torchrun --nnodes=2 --nproc_per_node=8 --node_rank=$RANK --master_addr=$MASTER --master_port=29500 \
        mae_pretrain_compile.py --data /datasets/imagenet/train --output /shared/mae_vitl
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from timm.models.vision_transformer import Block, PatchEmbed
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


class MAE(nn.Module):
    def __init__(self, img=224, patch=16, dim=1024, depth=24, heads=16, dec_dim=512, dec_depth=8, dec_heads=16,
                 mask_ratio=0.75):
        super().__init__()
        self.patch_embed = PatchEmbed(img, patch, 3, dim)
        n = self.patch_embed.num_patches
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, n + 1, dim), requires_grad=False)
        self.blocks = nn.ModuleList([Block(dim, heads, 4.0, qkv_bias=True) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.dec_embed = nn.Linear(dim, dec_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dec_dim))
        self.dec_pos_embed = nn.Parameter(torch.zeros(1, n + 1, dec_dim), requires_grad=False)
        self.dec_blocks = nn.ModuleList([Block(dec_dim, dec_heads, 4.0, qkv_bias=True) for _ in range(dec_depth)])
        self.dec_norm = nn.LayerNorm(dec_dim)
        self.dec_pred = nn.Linear(dec_dim, patch * patch * 3)
        self.patch = patch
        self.mask_ratio = mask_ratio
        nn.init.normal_(self.cls_token, std=0.02)
        nn.init.normal_(self.mask_token, std=0.02)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.dec_pos_embed, std=0.02)

    def patchify(self, imgs):
        p = self.patch
        h = w = imgs.shape[2] // p
        x = imgs.reshape(imgs.shape[0], 3, h, p, w, p)
        return torch.einsum("nchpwq->nhwpqc", x).reshape(imgs.shape[0], h * w, p * p * 3)

    def forward(self, imgs):
        x = self.patch_embed(imgs) + self.pos_embed[:, 1:]
        N, L, D = x.shape
        keep = int(L * (1 - self.mask_ratio))
        noise = torch.rand(N, L, device=x.device)
        ids_shuffle = noise.argsort(dim=1)
        ids_restore = ids_shuffle.argsort(dim=1)
        ids_keep = ids_shuffle[:, :keep]
        x = torch.gather(x, 1, ids_keep.unsqueeze(-1).expand(-1, -1, D))
        mask = torch.ones(N, L, device=x.device)
        mask[:, :keep] = 0
        mask = torch.gather(mask, 1, ids_restore)

        cls = (self.cls_token + self.pos_embed[:, :1]).expand(N, -1, -1)
        x = torch.cat([cls, x], dim=1)
        for blk in self.blocks:
            x = blk(x)
        x = self.dec_embed(self.norm(x))

        mask_tokens = self.mask_token.expand(N, L + 1 - x.shape[1], -1)
        x_ = torch.cat([x[:, 1:], mask_tokens], dim=1)
        x_ = torch.gather(x_, 1, ids_restore.unsqueeze(-1).expand(-1, -1, x.shape[2]))
        x = torch.cat([x[:, :1], x_], dim=1) + self.dec_pos_embed
        for blk in self.dec_blocks:
            x = blk(x)
        pred = self.dec_pred(self.dec_norm(x))[:, 1:]

        target = self.patchify(imgs)
        mean, var = target.mean(-1, keepdim=True), target.var(-1, keepdim=True)
        target = (target - mean) / (var + 1e-6) ** 0.5
        loss = ((pred.float() - target) ** 2).mean(-1)
        return (loss * mask).sum() / mask.sum()


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--epochs", type=int, default=800)
    p.add_argument("--warmup-epochs", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=256, help="per GPU")
    p.add_argument("--blr", type=float, default=1.5e-4, help="base lr, scaled by global batch / 256")
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--save-every", type=int, default=20)
    return p.parse_args()


def save_checkpoint(path, model, optimizer, epoch, args):
    tmp = path + ".tmp"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch,
                "args": vars(args)}, tmp)
    os.replace(tmp, path)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0 + rank)  # per-rank mask noise
    os.makedirs(args.output, exist_ok=True)

    tf = transforms.Compose([
        transforms.RandomResizedCrop(224, scale=(0.2, 1.0), interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    ])
    dataset = datasets.ImageFolder(args.data, tf)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = MAE().to(device)
    for blk in list(model.blocks) + list(model.dec_blocks):
        blk.compile()
    raw_model = model
    model = DDP(model, device_ids=[local_rank])

    eff_batch = args.batch_size * world
    lr = args.blr * eff_batch / 256
    params = [
        {"params": [p for n, p in raw_model.named_parameters() if p.requires_grad and p.ndim > 1], "weight_decay": args.weight_decay},
        {"params": [p for n, p in raw_model.named_parameters() if p.requires_grad and p.ndim <= 1], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), fused=True)
    iters_per_epoch = len(loader)

    start_epoch = 0
    last = os.path.join(args.output, "checkpoint-last.pth")
    if os.path.exists(last):
        ckpt = torch.load(last, map_location="cpu")
        raw_model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch = ckpt["epoch"] + 1

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros((), device=device)
        for i, (imgs, _) in enumerate(loader):
            it = epoch + i / iters_per_epoch
            if it < args.warmup_epochs:
                cur_lr = lr * it / args.warmup_epochs
            else:
                cur_lr = lr * 0.5 * (1 + math.cos(math.pi * (it - args.warmup_epochs) / (args.epochs - args.warmup_epochs)))
            for g in optimizer.param_groups:
                g["lr"] = cur_lr

            imgs = imgs.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(imgs)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum += loss.detach()

            if rank == 0 and i % 100 == 0:
                print(f"epoch {epoch} [{i}/{iters_per_epoch}] loss {loss.item():.4f} lr {cur_lr:.2e}", flush=True)

        dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
        if rank == 0:
            print(f"epoch {epoch} mean loss {loss_sum.item() / iters_per_epoch:.4f} "
                  f"{iters_per_epoch * eff_batch / (time.time() - t0):.0f} img/s", flush=True)

        save_checkpoint(last, raw_model, optimizer, epoch, args)
        if (epoch + 1) % args.save_every == 0:
            save_checkpoint(os.path.join(args.output, f"checkpoint-{epoch + 1}.pth"), raw_model, optimizer, epoch, args)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
