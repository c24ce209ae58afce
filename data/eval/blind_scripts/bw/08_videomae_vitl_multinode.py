"""VideoMAE ViT-L/16 fine-tuning on Kinetics-400, 2 nodes x 8 GPUs.

Run on every node (outputs must be on the shared filesystem):

    torchrun --nnodes=2 --nproc_per_node=8 --node_rank=$NODE_RANK \
        --master_addr=$MASTER_ADDR --master_port=29500 08_videomae_vitl_multinode.py \
        --data_path /mnt/lustre/k400/lists --video_root /mnt/lustre/k400/videos \
        --finetune /mnt/lustre/ckpt/videomae_vitl_pretrain.pth \
        --output_dir /mnt/lustre/exp/vmae_vitl_ft --use_checkpoint
"""
import argparse
import glob
import math
import os
import random
import re

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as cp
from decord import VideoReader, cpu
from timm.data import Mixup
from timm.loss import SoftTargetCrossEntropy
from timm.models.layers import DropPath, Mlp, trunc_normal_
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_path", required=True)
    p.add_argument("--video_root", required=True)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--finetune", default="")
    p.add_argument("--nb_classes", type=int, default=400)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--warmup_epochs", type=int, default=5)
    p.add_argument("--blr", type=float, default=1e-3)
    p.add_argument("--min_lr", type=float, default=1e-6)
    p.add_argument("--layer_decay", type=float, default=0.8)
    p.add_argument("--weight_decay", type=float, default=0.05)
    p.add_argument("--drop_path", type=float, default=0.2)
    p.add_argument("--use_checkpoint", action="store_true", help="activation checkpointing in blocks")
    p.add_argument("--num_workers", type=int, default=12)
    p.add_argument("--save_ckpt_freq", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def init_distributed_mode(args):
    args.rank = int(os.environ["RANK"])
    args.world_size = int(os.environ["WORLD_SIZE"])
    args.gpu = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(args.gpu)
    dist.init_process_group(backend="nccl", init_method="env://",
                            world_size=args.world_size, rank=args.rank)
    dist.barrier()


def is_main_process():
    return dist.get_rank() == 0


# --------------------------------------------------------------------------- model
class Block(nn.Module):
    def __init__(self, dim, heads, drop_path):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, dim * 4)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def attn(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, C))

    def forward(self, x):
        x = x + self.drop_path(self.attn(self.norm1(x)))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class VisionTransformer3D(nn.Module):
    def __init__(self, num_classes, frames=16, img=224, patch=16, tubelet=2, dim=1024, depth=24, heads=16,
                 drop_path_rate=0.2, use_checkpoint=False):
        super().__init__()
        self.use_checkpoint = use_checkpoint
        self.patch_embed = nn.Conv3d(3, dim, (tubelet, patch, patch), (tubelet, patch, patch))
        n = (frames // tubelet) * (img // patch) ** 2
        pos = torch.arange(n).float()[:, None] / torch.pow(10000, 2 * (torch.arange(dim) // 2).float() / dim)
        pos[:, 0::2], pos[:, 1::2] = pos[:, 0::2].sin(), pos[:, 1::2].cos()
        self.register_buffer("pos_embed", pos[None], persistent=False)
        dpr = torch.linspace(0, drop_path_rate, depth).tolist()
        self.blocks = nn.ModuleList(Block(dim, heads, d) for d in dpr)
        self.fc_norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, num_classes)
        trunc_normal_(self.head.weight, std=0.02)
        self.head.weight.data.mul_(0.001)
        nn.init.zeros_(self.head.bias)

    def get_num_layers(self):
        return len(self.blocks)

    def no_weight_decay(self):
        return {"pos_embed"}

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2) + self.pos_embed.type_as(x)
        for blk in self.blocks:
            if self.use_checkpoint and self.training:
                # non-reentrant checkpointing works with DDP's autograd hooks
                x = cp.checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
        return self.head(self.fc_norm(x.mean(1)))


def layer_decay_groups(model, wd, layer_decay):
    num_layers = model.get_num_layers() + 1
    skip = model.no_weight_decay()
    groups = {}
    for name, p in model.named_parameters():
        if name.startswith("patch_embed"):
            lid = 0
        elif name.startswith("blocks."):
            lid = int(name.split(".")[1]) + 1
        else:
            lid = num_layers
        no_wd = p.ndim == 1 or name in skip
        key = (lid, no_wd)
        if key not in groups:
            groups[key] = {"params": [], "weight_decay": 0.0 if no_wd else wd,
                           "lr_scale": layer_decay ** (num_layers - lid)}
        groups[key]["params"].append(p)
    return list(groups.values())


# --------------------------------------------------------------------------- data
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1, 1)


class Kinetics(Dataset):
    def __init__(self, list_file, root, train, num_segment=1, num_crop=1, frames=16, rate=4, size=224):
        with open(list_file) as f:
            self.samples = [(os.path.join(root, a), int(b)) for a, b in (l.rsplit(" ", 1) for l in f if l.strip())]
        self.train, self.num_segment, self.num_crop = train, num_segment, num_crop
        self.frames, self.rate, self.size = frames, rate, size

    def __len__(self):
        return len(self.samples) * self.num_segment * self.num_crop

    def __getitem__(self, idx):
        vid, view = divmod(idx, self.num_segment * self.num_crop)
        seg, crop = divmod(view, self.num_crop)
        path, label = self.samples[vid]
        vr = VideoReader(path, ctx=cpu(0), num_threads=1)
        n, span = len(vr), self.frames * self.rate
        if self.train:
            s = random.randint(0, max(0, n - span))
        else:
            s = int(max(0, n - span) * seg / max(1, self.num_segment - 1))
        x = vr.get_batch(np.minimum(np.arange(s, s + span, self.rate), n - 1)).asnumpy()
        x = torch.from_numpy(x).permute(0, 3, 1, 2).float() / 255
        h, w = x.shape[-2:]
        if self.train:
            sc = random.uniform(0.3, 1.0) ** 0.5
            ch, cw = int(h * sc), int(w * sc)
            i, j = random.randint(0, h - ch), random.randint(0, w - cw)
            x = F.interpolate(x[..., i:i + ch, j:j + cw], (self.size, self.size), mode="bilinear")
            if random.random() < 0.5:
                x = x.flip(-1)
        else:
            r = self.size / min(h, w)
            x = F.interpolate(x, (max(self.size, round(h * r)), max(self.size, round(w * r))), mode="bilinear")
            h, w = x.shape[-2:]
            k = crop if self.num_crop > 1 else 1
            i = (h - self.size) * k // 2 if h > w else (h - self.size) // 2
            j = (w - self.size) * k // 2 if w >= h else (w - self.size) // 2
            x = x[..., i:i + self.size, j:j + self.size]
        return (x.transpose(0, 1) - MEAN) / STD, label, vid


class SequentialShard(Sampler):
    def __init__(self, n, world, rank):
        per = math.ceil(n / world)
        self.ids = list(range(rank * per, min(n, (rank + 1) * per)))

    def __iter__(self):
        return iter(self.ids)

    def __len__(self):
        return len(self.ids)


@torch.no_grad()
def multi_view_test(model, loader, num_videos, num_classes, device):
    model.eval()
    acc = torch.zeros(num_videos, num_classes + 2, device=device)  # scores | views | label
    for x, y, v in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x.to(device, non_blocking=True))
        v = v.to(device)
        acc[:, :num_classes].index_add_(0, v, logits.float().softmax(-1))
        acc[:, num_classes].index_add_(0, v, torch.ones(len(v), device=device))
        acc[v, num_classes + 1] = y.to(device).float()
    # each video's views live on exactly one rank, so a sum recovers everything
    dist.all_reduce(acc)
    scores = acc[:, :num_classes] / acc[:, num_classes:num_classes + 1].clamp(min=1)
    labels = acc[:, num_classes + 1].long()
    top5 = scores.topk(5, 1).indices
    return (top5[:, 0] == labels).float().mean().item() * 100, (top5 == labels[:, None]).any(1).float().mean().item() * 100


def main():
    args = get_args()
    init_distributed_mode(args)
    device = torch.device("cuda", args.gpu)
    torch.manual_seed(args.seed + args.rank)
    np.random.seed(args.seed + args.rank)
    random.seed(args.seed + args.rank)
    torch.backends.cuda.matmul.allow_tf32 = True

    train_set = Kinetics(os.path.join(args.data_path, "train.csv"), args.video_root, train=True)
    test_set = Kinetics(os.path.join(args.data_path, "val.csv"), args.video_root, train=False,
                        num_segment=4, num_crop=3)
    sampler_train = DistributedSampler(train_set, num_replicas=args.world_size, rank=args.rank,
                                       shuffle=True, seed=args.seed)
    loader_train = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler_train,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    # 4x3 views per video: keep all views of one video on the same rank
    views = test_set.num_segment * test_set.num_crop
    n_videos = len(test_set.samples)
    shard = SequentialShard(n_videos, args.world_size, args.rank)
    test_ids = [vid * views + k for vid in shard for k in range(views)]
    loader_test = DataLoader(torch.utils.data.Subset(test_set, test_ids), batch_size=args.batch_size,
                             num_workers=args.num_workers, pin_memory=True)

    model = VisionTransformer3D(args.nb_classes, drop_path_rate=args.drop_path, use_checkpoint=args.use_checkpoint)
    if args.finetune:
        ckpt = torch.load(args.finetune, map_location="cpu")
        sd = ckpt.get("model", ckpt)
        sd = {k[len("encoder."):] if k.startswith("encoder.") else k: v for k, v in sd.items()
              if not k.startswith(("decoder", "mask_token", "encoder_to_decoder", "head"))}
        msg = model.load_state_dict(sd, strict=False)
        if is_main_process():
            print(msg)
    model.to(device)
    model_without_ddp = model
    model = nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])

    eff_batch = args.batch_size * args.world_size
    lr = args.blr * eff_batch / 256
    optimizer = torch.optim.AdamW(layer_decay_groups(model_without_ddp, args.weight_decay, args.layer_decay),
                                  lr=lr, betas=(0.9, 0.999))
    scaler = torch.cuda.amp.GradScaler()
    mixup_fn = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=args.nb_classes)
    criterion = SoftTargetCrossEntropy()
    iters = len(loader_train)
    warm, total = args.warmup_epochs * iters, args.epochs * iters

    def lr_at(step):
        if step < warm:
            return lr * step / warm
        return args.min_lr + (lr - args.min_lr) * 0.5 * (1 + math.cos(math.pi * (step - warm) / (total - warm)))

    start_epoch = 0
    ckpts = sorted(glob.glob(os.path.join(args.output_dir, "checkpoint-*.pth")),
                   key=lambda p: int(re.findall(r"checkpoint-(\d+)", p)[0]))
    if ckpts:
        state = torch.load(ckpts[-1], map_location="cpu")
        model_without_ddp.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        start_epoch = state["epoch"] + 1

    writer = None
    if is_main_process():
        os.makedirs(args.output_dir, exist_ok=True)
        writer = SummaryWriter(log_dir=os.path.join(args.output_dir, "tb"))
        print(f"effective batch {eff_batch}, lr {lr:.2e}, resume from epoch {start_epoch}")

    for epoch in range(start_epoch, args.epochs):
        sampler_train.set_epoch(epoch)
        model.train()
        stats = torch.zeros(2, device=device)
        for it, (x, y, _) in enumerate(loader_train):
            step = epoch * iters + it
            for g in optimizer.param_groups:
                g["lr"] = lr_at(step) * g["lr_scale"]
            x, y = mixup_fn(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            gnorm = nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(optimizer)
            scaler.update()
            stats += torch.stack([loss.detach().float(), torch.ones((), device=device)])
            if writer is not None and it % 20 == 0:
                writer.add_scalar("train/loss_step", loss.item(), step)
                writer.add_scalar("train/grad_norm", gnorm.item(), step)
                writer.add_scalar("train/lr", lr_at(step), step)
        dist.all_reduce(stats)
        if writer is not None:
            writer.add_scalar("train/loss_epoch", (stats[0] / stats[1]).item(), epoch)
            if (epoch + 1) % args.save_ckpt_freq == 0 or epoch + 1 == args.epochs:
                torch.save({"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                            "scaler": scaler.state_dict(), "epoch": epoch, "args": vars(args)},
                           os.path.join(args.output_dir, f"checkpoint-{epoch}.pth"))

    top1, top5 = multi_view_test(model_without_ddp, loader_test, n_videos, args.nb_classes, device)
    if writer is not None:
        writer.add_scalar("test/top1", top1, args.epochs)
        writer.add_scalar("test/top5", top5, args.epochs)
        writer.close()
        print(f"4x3 views: top1 {top1:.2f} top5 {top5:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
