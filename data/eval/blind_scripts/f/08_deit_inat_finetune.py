"""DeiT-B fine-tuning on iNaturalist-2019 at 384px (distillation token kept in the model,
distillation loss optional). Gradient checkpointing keeps 384px / batch 48 within 40GB.

    torchrun --nproc_per_node=8 finetune_deit.py --data /data/inat2019 --finetune deit_base_distilled_224.pth \
        --input-size 384 --batch-size 48 --grad-ckpt --epochs 100
"""
import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from timm.data import Mixup, create_transform
from timm.layers import PatchEmbed, trunc_normal_
from timm.loss import SoftTargetCrossEntropy
from timm.models.vision_transformer import Block
from timm.utils import ModelEmaV2, accuracy
from torchvision import datasets, transforms


class DistilledViT(nn.Module):
    def __init__(self, img_size=224, patch_size=16, num_classes=1000, embed_dim=768, depth=12,
                 num_heads=12, drop_path_rate=0.1, grad_ckpt=False):
        super().__init__()
        self.patch_embed = PatchEmbed(img_size=img_size, patch_size=patch_size, embed_dim=embed_dim)
        n = self.patch_embed.num_patches
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.dist_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, n + 2, embed_dim))
        dpr = [x.item() for x in torch.linspace(0, drop_path_rate, depth)]
        self.blocks = nn.ModuleList([Block(embed_dim, num_heads, 4.0, qkv_bias=True, drop_path=dpr[i])
                                     for i in range(depth)])
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.head = nn.Linear(embed_dim, num_classes)
        self.head_dist = nn.Linear(embed_dim, num_classes)
        self.grad_ckpt = grad_ckpt
        trunc_normal_(self.pos_embed, std=0.02)
        trunc_normal_(self.cls_token, std=0.02)
        trunc_normal_(self.dist_token, std=0.02)

    def forward(self, x, distill=False):
        x = self.patch_embed(x)
        B = x.shape[0]
        x = torch.cat([self.cls_token.expand(B, -1, -1), self.dist_token.expand(B, -1, -1), x], dim=1)
        x = x + self.pos_embed
        for blk in self.blocks:
            if self.grad_ckpt and self.training:
                x = torch.utils.checkpoint.checkpoint(blk, x)
            else:
                x = blk(x)
        x = self.norm(x)
        if distill:
            return self.head(x[:, 0]), self.head_dist(x[:, 1])
        return self.head(x[:, 0])


def resize_pos_embed(state, model):
    pe = state["pos_embed"]
    extra, grid = pe[:, :2], pe[:, 2:]
    old = int(math.sqrt(grid.shape[1]))
    new = int(math.sqrt(model.patch_embed.num_patches))
    grid = grid.reshape(1, old, old, -1).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, size=(new, new), mode="bicubic", align_corners=False)
    state["pos_embed"] = torch.cat([extra, grid.permute(0, 2, 3, 1).reshape(1, new * new, -1)], dim=1)
    return state


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--finetune", default="")
    p.add_argument("--nb-classes", type=int, default=1010)
    p.add_argument("--input-size", type=int, default=384)
    p.add_argument("--batch-size", type=int, default=48)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--lr", type=float, default=5e-4, help="for batch 512")
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--mixup", type=float, default=0.8)
    p.add_argument("--cutmix", type=float, default=1.0)
    p.add_argument("--smoothing", type=float, default=0.1)
    p.add_argument("--model-ema-decay", type=float, default=0.99996)
    p.add_argument("--grad-ckpt", action="store_true")
    p.add_argument("--output-dir", default="output/deit_b_inat19")
    p.add_argument("--workers", type=int, default=10)
    return p.parse_args()


@torch.no_grad()
def evaluate(loader, model, device):
    model.eval()
    stats = torch.zeros(3, device=device)
    for images, target in loader:
        images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            output = model(images)
        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        n = images.shape[0]
        stats += torch.tensor([acc1.item() * n / 100, acc5.item() * n / 100, n], device=device)
    dist.all_reduce(stats)
    return 100 * stats[0].item() / stats[2].item(), 100 * stats[1].item() / stats[2].item()


def main(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_tf = create_transform(args.input_size, is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
                                re_prob=0.25, interpolation="bicubic")
    val_tf = transforms.Compose([transforms.Resize(int(args.input_size / 0.875), interpolation=3),
                                 transforms.CenterCrop(args.input_size), transforms.ToTensor(),
                                 transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    train_sampler = torch.utils.data.DistributedSampler(train_set, shuffle=True)
    val_sampler = torch.utils.data.DistributedSampler(val_set, shuffle=False)
    train_loader = torch.utils.data.DataLoader(train_set, sampler=train_sampler, batch_size=args.batch_size,
                                               num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = torch.utils.data.DataLoader(val_set, sampler=val_sampler, batch_size=2 * args.batch_size,
                                             num_workers=args.workers, pin_memory=True)

    model = DistilledViT(img_size=args.input_size, num_classes=args.nb_classes, grad_ckpt=args.grad_ckpt)
    if args.finetune:
        state = torch.load(args.finetune, map_location="cpu")["model"]
        for k in ("head.weight", "head.bias", "head_dist.weight", "head_dist.bias"):
            state.pop(k, None)
        msg = model.load_state_dict(resize_pos_embed(state, model), strict=False)
        if rank == 0:
            print(msg)
    model.to(device)
    model_ema = ModelEmaV2(model, decay=args.model_ema_decay)
    # head_dist only gets gradients when a teacher is used; here we fine-tune without one
    model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank], find_unused_parameters=True)

    lr = args.lr * args.batch_size * world_size / 512.0
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.weight_decay)
    steps_per_epoch = len(train_loader)
    warmup = args.warmup_epochs * steps_per_epoch
    total = args.epochs * steps_per_epoch
    lr_lambda = lambda s: s / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / (total - warmup)))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    scaler = torch.cuda.amp.GradScaler()
    mixup_fn = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, label_smoothing=args.smoothing,
                     num_classes=args.nb_classes)
    criterion = SoftTargetCrossEntropy()

    best = 0.0
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, (images, targets) in enumerate(train_loader):
            images, targets = images.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            images, targets = mixup_fn(images, targets)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(model(images), targets)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            model_ema.update(model.module)
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} [{step}/{steps_per_epoch}] loss {loss.item():.4f} (rank0) "
                      f"lr {scheduler.get_last_lr()[0]:.2e}", flush=True)

        top1, top5 = evaluate(val_loader, model, device)
        ema_top1, _ = evaluate(val_loader, model_ema.module, device)
        if rank == 0:
            print(json.dumps({"epoch": epoch, "top1": top1, "top5": top5, "ema_top1": ema_top1,
                              "time": time.time() - t0}), flush=True)
            ckpt = {"model": model.module.state_dict(), "model_ema": model_ema.module.state_dict(),
                    "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(), "epoch": epoch}
            torch.save(ckpt, os.path.join(args.output_dir, "checkpoint.pth"))
            if top1 > best:
                best = top1
                torch.save(ckpt, os.path.join(args.output_dir, "best.pth"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(get_args())
