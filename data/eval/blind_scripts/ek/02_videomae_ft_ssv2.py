# VideoMAE ViT-B/16 fine-tuning on Something-Something V2.
# torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29400 \
#     02_videomae_ft_ssv2.py --data_path /mnt/shared/ssv2 --finetune /mnt/shared/ckpt/videomae_b_ssv2_pt.pth
import argparse
import datetime
import json
import math
import os
import time
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as cp
from decord import VideoReader, cpu
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1, 1)


def get_args():
    parser = argparse.ArgumentParser("VideoMAE fine-tuning", add_help=True)
    parser.add_argument("--data_path", type=str, required=True)
    parser.add_argument("--finetune", type=str, default="")
    parser.add_argument("--output_dir", type=str, default="/mnt/shared/exp/videomae_ft_ssv2")
    parser.add_argument("--nb_classes", type=int, default=174)
    parser.add_argument("--num_frames", type=int, default=16)
    parser.add_argument("--batch_size", type=int, default=12)
    parser.add_argument("--update_freq", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--warmup_epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=5e-4, help="base lr per 256 samples")
    parser.add_argument("--min_lr", type=float, default=1e-6)
    parser.add_argument("--weight_decay", type=float, default=0.05)
    parser.add_argument("--layer_decay", type=float, default=0.75)
    parser.add_argument("--drop_path", type=float, default=0.1)
    parser.add_argument("--smoothing", type=float, default=0.1)
    parser.add_argument("--use_checkpoint", action="store_true")
    parser.add_argument("--test_num_segment", type=int, default=2)
    parser.add_argument("--test_num_crop", type=int, default=3)
    parser.add_argument("--num_workers", type=int, default=10)
    parser.add_argument("--save_ckpt_freq", type=int, default=5)
    return parser.parse_args()


class DropPath(nn.Module):
    def __init__(self, p=0.0):
        super().__init__()
        self.p = p

    def forward(self, x):
        if self.p == 0.0 or not self.training:
            return x
        keep = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(1 - self.p)
        return x * keep / (1 - self.p)


class Block(nn.Module):
    def __init__(self, dim, heads, drop_path):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, dim * 4), nn.GELU(), nn.Linear(dim * 4, dim))
        self.drop_path = DropPath(drop_path)

    def attn(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(B, N, C))

    def forward(self, x):
        x = x + self.drop_path(self.attn(self.norm1(x)))
        return x + self.drop_path(self.mlp(self.norm2(x)))


def sinusoid_table(n_position, d_hid):
    pos = np.arange(n_position)[:, None] / np.power(10000, 2 * (np.arange(d_hid) // 2) / d_hid)
    pos[:, 0::2] = np.sin(pos[:, 0::2])
    pos[:, 1::2] = np.cos(pos[:, 1::2])
    return torch.tensor(pos, dtype=torch.float32).unsqueeze(0)


class VideoViT(nn.Module):
    def __init__(self, num_classes, num_frames=16, img_size=224, patch=16, tubelet=2, dim=768, depth=12,
                 heads=12, drop_path=0.1, use_checkpoint=False):
        super().__init__()
        self.patch_embed = nn.Conv3d(3, dim, (tubelet, patch, patch), (tubelet, patch, patch))
        n = (num_frames // tubelet) * (img_size // patch) ** 2
        self.register_buffer("pos_embed", sinusoid_table(n, dim), persistent=False)
        dpr = [x.item() for x in torch.linspace(0, drop_path, depth)]
        self.blocks = nn.ModuleList([Block(dim, heads, dpr[i]) for i in range(depth)])
        self.fc_norm = nn.LayerNorm(dim, eps=1e-6)
        self.fc_dropout = nn.Dropout(0.5)
        self.head = nn.Linear(dim, num_classes)
        self.use_checkpoint = use_checkpoint
        nn.init.trunc_normal_(self.head.weight, std=0.02)
        self.head.weight.data.mul_(0.001)
        nn.init.zeros_(self.head.bias)

    def get_num_layers(self):
        return len(self.blocks)

    def no_weight_decay(self):
        return {"pos_embed", "cls_token"}

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2) + self.pos_embed
        for blk in self.blocks:
            if self.use_checkpoint and self.training:
                x = cp.checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
        return self.head(self.fc_dropout(self.fc_norm(x.mean(1))))


class SSV2(Dataset):
    """TSN-style segment sampling; test mode returns all segments x crops of a video."""

    def __init__(self, root, split, num_frames, test_num_segment=2, test_num_crop=3):
        self.root, self.split, self.num_frames = root, split, num_frames
        self.test_num_segment, self.test_num_crop = test_num_segment, test_num_crop
        with open(os.path.join(root, f"{split}.csv")) as f:
            self.items = [(l.split()[0], int(l.split()[-1])) for l in f if l.strip()]

    def __len__(self):
        return len(self.items)

    def _indices(self, n, seg_id=None):
        seg = n / self.num_frames
        if seg_id is None:
            return np.minimum((np.arange(self.num_frames) * seg + np.random.uniform(0, seg, self.num_frames)).astype(int), n - 1)
        off = seg * (seg_id + 1) / (self.test_num_segment + 1)
        return np.minimum((np.arange(self.num_frames) * seg + off).astype(int), n - 1)

    @staticmethod
    def _to_tensor(frames, short=224):
        x = torch.from_numpy(frames).permute(3, 0, 1, 2).float() / 255.0  # C,T,H,W
        h, w = x.shape[-2:]
        s = short / min(h, w)
        x = F.interpolate(x, size=(round(h * s), round(w * s)), mode="bilinear", align_corners=False)
        return x

    def __getitem__(self, idx):
        name, label = self.items[idx]
        vr = VideoReader(os.path.join(self.root, "videos", name), num_threads=1, ctx=cpu(0))
        n = len(vr)
        if self.split == "train":
            x = self._to_tensor(vr.get_batch(self._indices(n)).asnumpy(), short=int(np.random.randint(224, 321)))
            h, w = x.shape[-2:]
            i, j = np.random.randint(0, h - 223), np.random.randint(0, w - 223)
            return (x[..., i:i + 224, j:j + 224] - MEAN) / STD, label  # no flip on SSv2
        views = []
        for s in range(self.test_num_segment):
            x = self._to_tensor(vr.get_batch(self._indices(n, s)).asnumpy())
            h, w = x.shape[-2:]
            for c in range(self.test_num_crop):
                off = (max(h, w) - 224) * c // max(self.test_num_crop - 1, 1)
                crop = x[..., :, off:off + 224] if w >= h else x[..., off:off + 224, :]
                views.append((crop - MEAN) / STD)
        return torch.stack(views), label


def param_groups(model, weight_decay, layer_decay):
    num_layers = model.get_num_layers() + 2
    skip = model.no_weight_decay()
    groups = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        no_decay = p.ndim == 1 or name.endswith(".bias") or name in skip
        if name.startswith("patch_embed"):
            layer_id = 0
        elif name.startswith("blocks."):
            layer_id = int(name.split(".")[1]) + 1
        else:
            layer_id = num_layers - 1
        key = f"layer_{layer_id}_{'no_decay' if no_decay else 'decay'}"
        if key not in groups:
            groups[key] = {"params": [], "weight_decay": 0.0 if no_decay else weight_decay,
                           "lr_scale": layer_decay ** (num_layers - 1 - layer_id)}
        groups[key]["params"].append(p)
    return list(groups.values())


def cosine_lr(step, total, warmup, base, min_lr):
    if step < warmup:
        return base * step / warmup
    return min_lr + 0.5 * (base - min_lr) * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


@torch.no_grad()
def final_test(model, dataset, args, rank, world, device):
    # every rank scores a disjoint slice of videos; sums are reduced below
    idx = list(range(rank, len(dataset), world))
    loader = DataLoader(torch.utils.data.Subset(dataset, idx), batch_size=2, num_workers=args.num_workers)
    model.eval()
    stats = torch.zeros(3, device=device)
    for views, target in loader:
        b, v = views.shape[:2]
        target = target.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(views.to(device, non_blocking=True).flatten(0, 1))
        prob = out.float().softmax(-1).view(b, v, -1).mean(1)
        top5 = prob.topk(5, dim=1).indices
        stats[0] += (top5[:, 0] == target).sum()
        stats[1] += (top5 == target[:, None]).any(1).sum()
        stats[2] += b
    dist.all_reduce(stats)
    return (100 * stats[0] / stats[2]).item(), (100 * stats[1] / stats[2]).item()


def main(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", timeout=datetime.timedelta(minutes=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(42 + rank)
    np.random.seed(42 + rank)

    model = VideoViT(args.nb_classes, args.num_frames, drop_path=args.drop_path, use_checkpoint=args.use_checkpoint)
    if args.finetune:
        ckpt = torch.load(args.finetune, map_location="cpu")
        sd = ckpt.get("model", ckpt)
        sd = {k[len("encoder."):]: v for k, v in sd.items() if k.startswith("encoder.")}
        sd = {k: v for k, v in sd.items() if not k.startswith("head") and k != "norm.weight" and k != "norm.bias"}
        msg = model.load_state_dict(sd, strict=False)
        if rank == 0:
            print("load pretrained:", msg)
    model.to(device)
    model_without_ddp = model
    model = DDP(model, device_ids=[local_rank])

    train_set = SSV2(args.data_path, "train", args.num_frames)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.num_workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    total_batch = args.batch_size * args.update_freq * world
    lr = args.lr * total_batch / 256
    optimizer = torch.optim.AdamW(param_groups(model_without_ddp, args.weight_decay, args.layer_decay),
                                  lr=lr, betas=(0.9, 0.999))
    steps_per_epoch = len(loader) // args.update_freq
    total_steps, warmup_steps = args.epochs * steps_per_epoch, args.warmup_epochs * steps_per_epoch
    criterion = nn.CrossEntropyLoss(label_smoothing=args.smoothing)

    start_epoch = 0
    last = os.path.join(args.output_dir, "checkpoint-last.pth")
    if os.path.exists(last):
        ckpt = torch.load(last, map_location="cpu")
        model_without_ddp.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch = ckpt["epoch"] + 1
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"world {world} total batch {total_batch} lr {lr:.2e} steps/epoch {steps_per_epoch}")

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, loss_acc = time.time(), torch.zeros(2, device=device)
        optimizer.zero_grad(set_to_none=True)
        for it, (x, y) in enumerate(loader):
            step = epoch * steps_per_epoch + it // args.update_freq
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            sync = (it + 1) % args.update_freq == 0
            ctx = model.no_sync() if not sync else torch.enable_grad()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = criterion(model(x), y) / args.update_freq
                loss.backward()
            if sync:
                cur = cosine_lr(step, total_steps, warmup_steps, lr, args.min_lr)
                for g in optimizer.param_groups:
                    g["lr"] = cur * g["lr_scale"]
                torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            loss_acc += torch.stack([loss.detach() * args.update_freq, torch.ones((), device=device)])
            if rank == 0 and it % 100 == 0:
                print(f"[{epoch}][{it}/{len(loader)}] loss {loss.item() * args.update_freq:.4f}", flush=True)
        dist.all_reduce(loss_acc)
        if rank == 0:
            log = {"epoch": epoch, "train_loss": (loss_acc[0] / loss_acc[1]).item(), "time": time.time() - t0}
            with open(os.path.join(args.output_dir, "log.txt"), "a") as f:
                f.write(json.dumps(log) + "\n")
            ckpt = {"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}
            torch.save(ckpt, last + ".tmp")
            os.replace(last + ".tmp", last)
            if (epoch + 1) % args.save_ckpt_freq == 0:
                torch.save(ckpt, os.path.join(args.output_dir, f"checkpoint-{epoch}.pth"))
        dist.barrier()

    test_set = SSV2(args.data_path, "val", args.num_frames, args.test_num_segment, args.test_num_crop)
    top1, top5 = final_test(model_without_ddp, test_set, args, rank, world, device)
    if rank == 0:
        print(f"{args.test_num_segment}x{args.test_num_crop} views: top1 {top1:.2f} top5 {top5:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(get_args())
