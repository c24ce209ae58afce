# VideoMAE ViT-L/16 fine-tuning on Kinetics-400 (16x4), mixup/cutmix, activation checkpointing
# to fit 6 clips per 40GB A100.
#   torchrun --nproc_per_node=8 20_videomae_vitl_ckpt_memory.py --data_path /data/k400 \
#       --finetune ckpts/videomae_vit_l_k400_pt_1600e.pth --output_dir exps/vitl_k400 --use_checkpoint
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint
from decord import VideoReader, cpu
from timm.data import Mixup
from timm.loss import SoftTargetCrossEntropy
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def get_args():
    parser = argparse.ArgumentParser("VideoMAE ViT-L fine-tuning")
    parser.add_argument("--data_path", required=True)
    parser.add_argument("--finetune", default="")
    parser.add_argument("--output_dir", default="exps/vitl_k400")
    parser.add_argument("--nb_classes", type=int, default=400)
    parser.add_argument("--num_frames", type=int, default=16)
    parser.add_argument("--sampling_rate", type=int, default=4)
    parser.add_argument("--batch_size", type=int, default=6)
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--warmup_epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--min_lr", type=float, default=1e-6)
    parser.add_argument("--weight_decay", type=float, default=0.05)
    parser.add_argument("--drop_path", type=float, default=0.2)
    parser.add_argument("--mixup", type=float, default=0.8)
    parser.add_argument("--cutmix", type=float, default=1.0)
    parser.add_argument("--smoothing", type=float, default=0.1)
    parser.add_argument("--use_checkpoint", action="store_true")
    parser.add_argument("--num_workers", type=int, default=10)
    return parser.parse_args()


class Mlp(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim, num_heads, drop_path=0.0):
        super().__init__()
        self.num_heads = num_heads
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, dim * 4)
        self.drop_path = drop_path

    def _drop_path(self, x):
        if self.drop_path == 0.0 or not self.training:
            return x
        keep = x.new_empty(x.shape[0], 1, 1).bernoulli_(1 - self.drop_path)
        return x * keep.div_(1 - self.drop_path)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(self.norm1(x)).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2]).transpose(1, 2).reshape(B, N, C)
        x = x + self._drop_path(self.proj(attn))
        return x + self._drop_path(self.mlp(self.norm2(x)))


class VisionTransformer(nn.Module):
    def __init__(self, num_classes, num_frames=16, embed_dim=1024, depth=24, num_heads=16, drop_path_rate=0.2,
                 use_checkpoint=False):
        super().__init__()
        self.use_checkpoint = use_checkpoint
        self.patch_embed = nn.Conv3d(3, embed_dim, (2, 16, 16), (2, 16, 16))
        n = num_frames // 2 * 196
        table = np.arange(n)[:, None] / np.power(10000, 2 * (np.arange(embed_dim) // 2) / embed_dim)
        table[:, 0::2], table[:, 1::2] = np.sin(table[:, 0::2]), np.cos(table[:, 1::2])
        self.register_buffer("pos_embed", torch.from_numpy(table).float()[None], persistent=False)
        dpr = [x.item() for x in torch.linspace(0, drop_path_rate, depth)]
        self.blocks = nn.ModuleList([Block(embed_dim, num_heads, dpr[i]) for i in range(depth)])
        self.fc_norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.fc_dropout = nn.Dropout(0.5)
        self.head = nn.Linear(embed_dim, num_classes)
        nn.init.trunc_normal_(self.head.weight, std=0.02)
        self.head.weight.data.mul_(0.001)

    def forward_features(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2) + self.pos_embed
        for blk in self.blocks:
            if self.use_checkpoint:
                x = checkpoint.checkpoint(blk, x)
            else:
                x = blk(x)
        return self.fc_norm(x.mean(1))

    def forward(self, x):
        return self.head(self.fc_dropout(self.forward_features(x)))


class KineticsDataset(Dataset):
    def __init__(self, root, split, num_frames, rate):
        self.root, self.train, self.num_frames, self.rate = root, split == "train", num_frames, rate
        with open(os.path.join(root, f"{split}.csv")) as f:
            self.samples = [(l.split(" ")[0], int(l.split(" ")[1])) for l in f.read().splitlines() if l]
        self.split = split

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        fname, label = self.samples[i]
        vr = VideoReader(os.path.join(self.root, self.split, fname), num_threads=1, ctx=cpu(0))
        n, span = len(vr), self.num_frames * self.rate
        start = np.random.randint(0, max(n - span, 0) + 1) if self.train else max(n - span, 0) // 2
        x = vr.get_batch(np.minimum(np.arange(start, start + span, self.rate), n - 1)).asnumpy()
        x = torch.from_numpy(x).permute(3, 0, 1, 2).float() / 255.0
        h, w = x.shape[-2:]
        if self.train:
            s = math.sqrt(np.random.uniform(0.08, 1.0) * h * w)
            ch, cw = min(h, int(s)), min(w, int(s))
            t, l = np.random.randint(0, h - ch + 1), np.random.randint(0, w - cw + 1)
            x = F.interpolate(x[..., t:t + ch, l:l + cw], size=(224, 224), mode="bilinear", align_corners=False)
            if np.random.rand() < 0.5:
                x = x.flip(-1)
        else:
            x = F.interpolate(x, scale_factor=224 / min(h, w), mode="bilinear", align_corners=False)
            h, w = x.shape[-2:]
            x = x[..., (h - 224) // 2:(h - 224) // 2 + 224, (w - 224) // 2:(w - 224) // 2 + 224]
        mean = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1, 1)
        std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1, 1)
        return (x - mean) / std, label


@torch.no_grad()
def validation_one_epoch(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.cuda.amp.autocast():
            out = model(x)
        top5 = out.topk(5, 1).indices
        stats += torch.stack([(top5[:, 0] == y).sum(), (top5 == y[:, None]).any(1).sum(),
                              torch.tensor(y.shape[0], device=device)]).double()
    dist.all_reduce(stats)
    return (100 * stats[0] / stats[2]).item(), (100 * stats[1] / stats[2]).item()


def main(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(rank)
    np.random.seed(rank)

    model = VisionTransformer(args.nb_classes, args.num_frames, drop_path_rate=args.drop_path,
                              use_checkpoint=args.use_checkpoint)
    if args.finetune:
        sd = torch.load(args.finetune, map_location="cpu")["model"]
        sd = {k[8:]: v for k, v in sd.items() if k.startswith("encoder.") and not k.startswith("encoder.norm")}
        msg = model.load_state_dict(sd, strict=False)
        if rank == 0:
            print(msg)
    model.to(device)
    model_without_ddp = model
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank], find_unused_parameters=True)

    train_set = KineticsDataset(args.data_path, "train", args.num_frames, args.sampling_rate)
    val_set = KineticsDataset(args.data_path, "val", args.num_frames, args.sampling_rate)
    sampler_train = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader_train = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler_train,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    loader_val = DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world_size)),
                            batch_size=args.batch_size, num_workers=args.num_workers, pin_memory=True)

    mixup_fn = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, label_smoothing=args.smoothing,
                     num_classes=args.nb_classes)
    criterion = SoftTargetCrossEntropy()
    lr = args.lr * args.batch_size * world_size / 256
    decay = [p for n, p in model_without_ddp.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model_without_ddp.named_parameters() if p.ndim <= 1]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.999))
    scaler = torch.cuda.amp.GradScaler()
    steps = len(loader_train)
    warm, total = args.warmup_epochs * steps, args.epochs * steps
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)

    max_accuracy = 0.0
    for epoch in range(args.epochs):
        sampler_train.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (samples, targets) in enumerate(loader_train):
            step = epoch * steps + it
            cur = lr * step / warm if step < warm else \
                args.min_lr + (lr - args.min_lr) * 0.5 * (1 + math.cos(math.pi * (step - warm) / (total - warm)))
            for g in optimizer.param_groups:
                g["lr"] = cur
            samples, targets = samples.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            samples, targets = mixup_fn(samples, targets)
            with torch.cuda.amp.autocast():
                loss = criterion(model(samples), targets)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(optimizer)
            scaler.update()
            if rank == 0 and it % 50 == 0:
                print(f"Epoch [{epoch}] [{it}/{steps}] loss {loss.item():.4f} lr {cur:.2e} "
                      f"mem {torch.cuda.max_memory_allocated() / 2 ** 30:.1f}G", flush=True)

        acc1, acc5 = validation_one_epoch(model_without_ddp, loader_val, device)
        if rank == 0:
            max_accuracy = max(max_accuracy, acc1)
            print(f"epoch {epoch}: acc1 {acc1:.2f} acc5 {acc5:.2f} max {max_accuracy:.2f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch},
                       os.path.join(args.output_dir, "checkpoint-last.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main(get_args())
