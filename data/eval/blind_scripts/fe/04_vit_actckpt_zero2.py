"""ViT-H/14 ImageNet training: ZeRO-2 + DeepSpeed activation checkpointing.

    deepspeed --hostfile /etc/deepspeed/hostfile --num_nodes 2 --num_gpus 8 \
        04_vit_actckpt_zero2.py --deepspeed --deepspeed_config configs/vit_zero2.json \
        --data /datasets/imagenet --output /lustre/exp/vit_h14
"""
import argparse
import json
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import deepspeed
import deepspeed.comm as dist
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def parse():
    parser = argparse.ArgumentParser("vit")
    parser.add_argument("--data", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--patch", type=int, default=14)
    parser.add_argument("--dim", type=int, default=1280)
    parser.add_argument("--depth", type=int, default=32)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument("--drop-path", type=float, default=0.3)
    parser.add_argument("--epochs", type=int, default=90)
    parser.add_argument("--workers", type=int, default=10)
    parser.add_argument("--ckpt-layers", type=int, default=1,
                        help="checkpoint every n-th block (0 disables)")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class DropPath(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        keep = torch.rand(x.shape[0], 1, 1, device=x.device, dtype=x.dtype) >= self.p
        return x * keep / (1 - self.p)


class Block(nn.Module):
    def __init__(self, dim, heads, drop_path):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop_path = DropPath(drop_path)

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.drop_path(self.attn(h, h, h, need_weights=False)[0])
        return x + self.drop_path(self.mlp(self.norm2(x)))


class ViT(nn.Module):
    def __init__(self, args):
        super().__init__()
        n_patches = (args.img_size // args.patch) ** 2
        self.patch_embed = nn.Conv2d(3, args.dim, kernel_size=args.patch, stride=args.patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, args.dim))
        self.pos_embed = nn.Parameter(torch.randn(1, n_patches + 1, args.dim) * 0.02)
        dpr = torch.linspace(0, args.drop_path, args.depth).tolist()
        self.blocks = nn.ModuleList([Block(args.dim, args.heads, dpr[i]) for i in range(args.depth)])
        self.norm = nn.LayerNorm(args.dim)
        self.head = nn.Linear(args.dim, args.num_classes)
        self.ckpt_layers = args.ckpt_layers

    def forward(self, img):
        x = self.patch_embed(img).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.size(0), -1, -1), x], dim=1) + self.pos_embed
        for i, blk in enumerate(self.blocks):
            if self.training and self.ckpt_layers and i % self.ckpt_layers == 0:
                x = deepspeed.checkpointing.checkpoint(blk, x)
            else:
                x = blk(x)
        return self.head(self.norm(x[:, 0]))


def build_data(args):
    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(args.img_size, scale=(0.08, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.TrivialAugmentWide(),
        transforms.ToTensor(),
        normalize,
    ])
    val_tf = transforms.Compose([
        transforms.Resize(int(args.img_size / 0.875)),
        transforms.CenterCrop(args.img_size),
        transforms.ToTensor(),
        normalize,
    ])
    train = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    return train, val


@torch.no_grad()
def validate(engine, loader):
    engine.eval()
    stats = torch.zeros(3, device=engine.device)
    for img, target in loader:
        img = img.to(engine.device, dtype=torch.half, non_blocking=True)
        target = target.to(engine.device, non_blocking=True)
        logits = engine(img)
        stats[0] += F.cross_entropy(logits.float(), target, reduction="sum")
        stats[1] += (logits.argmax(-1) == target).sum()
        stats[2] += target.numel()
    dist.all_reduce(stats)
    engine.train()
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed()
    rank = dist.get_rank()
    world = dist.get_world_size()

    with open(args.deepspeed_config) as f:
        ds_cfg = json.load(f)
    deepspeed.checkpointing.configure(None, deepspeed_config=args.deepspeed_config,
                                      partition_activations=False,
                                      checkpoint_in_cpu=False,
                                      contiguous_checkpointing=False,
                                      synchronize=False, profile=False)

    torch.manual_seed(0)
    model = ViT(args)
    train_set, val_set = build_data(args)
    train_sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True)
    val_sampler = DistributedSampler(val_set, num_replicas=world, rank=rank, shuffle=False)

    mbs = ds_cfg["train_micro_batch_size_per_gpu"]
    train_loader = DataLoader(train_set, batch_size=mbs, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=mbs, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1 or n.endswith(("cls_token", "pos_embed"))]
    decay = [p for n, p in model.named_parameters() if not (p.ndim <= 1 or n.endswith(("cls_token", "pos_embed")))]
    engine, optimizer, _, scheduler = deepspeed.initialize(
        args=args, model=model,
        model_parameters=[{"params": decay, "weight_decay": 0.05},
                          {"params": no_decay, "weight_decay": 0.0}])

    start_epoch = 0
    load_path, client = engine.load_checkpoint(args.output)
    if load_path is not None:
        start_epoch = client["epoch"] + 1
        if rank == 0:
            print(f"resumed from {load_path} at epoch {start_epoch}")

    best_acc = 0.0
    for epoch in range(start_epoch, args.epochs):
        t0 = time.time()
        for i, (img, target) in enumerate(train_loader):
            img = img.to(engine.device, dtype=torch.half, non_blocking=True)
            target = target.to(engine.device, non_blocking=True)
            logits = engine(img)
            loss = F.cross_entropy(logits.float(), target, label_smoothing=0.1)
            engine.backward(loss)
            engine.step()
            if rank == 0 and i % 100 == 0:
                print(f"epoch {epoch} it {i}/{len(train_loader)} loss {loss.item():.4f} "
                      f"lr {engine.get_lr()[0]:.2e} {(time.time() - t0) / (i + 1):.3f}s/it")

        val_loss, val_acc = validate(engine, val_loader)
        if rank == 0:
            print(f"epoch {epoch} val_loss {val_loss:.4f} top1 {val_acc * 100:.2f}")
        best_acc = max(best_acc, val_acc)
        engine.save_checkpoint(args.output, tag=f"epoch{epoch}",
                               client_state={"epoch": epoch, "best_acc": best_acc})

    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
