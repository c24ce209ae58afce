# Fine-tune a VideoMAE-pretrained ViT-B/16 on Kinetics-400.
# Layer-wise lr decay, mixup/cutmix, drop path, 5x3 view testing.
#
#   torchrun --nproc_per_node=8 04_videomae_finetune_lrd.py \
#       --data_path /data/k400/lists --data_root /data/k400/videos \
#       --finetune /ckpt/videomae_vitb_k400_pretrain_1600e.pth --output_dir /ckpt/vmae_ft
import argparse
import datetime
import json
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from decord import VideoReader, cpu
from timm.data import Mixup
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.models.layers import DropPath, Mlp, trunc_normal_
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler


def get_args():
    parser = argparse.ArgumentParser("VideoMAE fine-tuning", add_help=True)
    parser.add_argument("--data_path", required=True, help="folder with train.csv / val.csv")
    parser.add_argument("--data_root", required=True)
    parser.add_argument("--nb_classes", type=int, default=400)
    parser.add_argument("--num_frames", type=int, default=16)
    parser.add_argument("--sampling_rate", type=int, default=4)
    parser.add_argument("--input_size", type=int, default=224)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=75)
    parser.add_argument("--warmup_epochs", type=int, default=5)
    parser.add_argument("--blr", type=float, default=5e-4)
    parser.add_argument("--min_lr", type=float, default=1e-6)
    parser.add_argument("--weight_decay", type=float, default=0.05)
    parser.add_argument("--layer_decay", type=float, default=0.75)
    parser.add_argument("--drop_path", type=float, default=0.1)
    parser.add_argument("--mixup", type=float, default=0.8)
    parser.add_argument("--cutmix", type=float, default=1.0)
    parser.add_argument("--smoothing", type=float, default=0.1)
    parser.add_argument("--clip_grad", type=float, default=None)
    parser.add_argument("--test_num_segment", type=int, default=5)
    parser.add_argument("--test_num_crop", type=int, default=3)
    parser.add_argument("--finetune", default="")
    parser.add_argument("--output_dir", default="./output")
    parser.add_argument("--num_workers", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


# ------------------------------------------------------------------ model
class Attention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        x = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        return self.proj(x.transpose(1, 2).reshape(B, N, C))


class Block(nn.Module):
    def __init__(self, dim, num_heads, drop_path):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads)
        self.drop_path = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(in_features=dim, hidden_features=dim * 4)

    def forward(self, x):
        x = x + self.drop_path(self.attn(self.norm1(x)))
        return x + self.drop_path(self.mlp(self.norm2(x)))


def sinusoid_table(n_position, d_hid):
    pos = np.arange(n_position)[:, None]
    i = np.arange(d_hid)[None, :]
    table = pos / np.power(10000, 2 * (i // 2) / d_hid)
    table[:, 0::2] = np.sin(table[:, 0::2])
    table[:, 1::2] = np.cos(table[:, 1::2])
    return torch.tensor(table, dtype=torch.float32).unsqueeze(0)


class VideoViT(nn.Module):
    def __init__(self, num_classes=400, img_size=224, patch_size=16, num_frames=16, tubelet_size=2,
                 embed_dim=768, depth=12, num_heads=12, drop_path_rate=0.1, init_scale=0.001):
        super().__init__()
        self.patch_embed = nn.Conv3d(3, embed_dim, kernel_size=(tubelet_size, patch_size, patch_size),
                                     stride=(tubelet_size, patch_size, patch_size))
        num_patches = (num_frames // tubelet_size) * (img_size // patch_size) ** 2
        self.register_buffer("pos_embed", sinusoid_table(num_patches, embed_dim), persistent=False)
        dpr = [x.item() for x in torch.linspace(0, drop_path_rate, depth)]
        self.blocks = nn.ModuleList([Block(embed_dim, num_heads, dpr[i]) for i in range(depth)])
        self.fc_norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.head = nn.Linear(embed_dim, num_classes)
        self.apply(self._init_weights)
        self.head.weight.data.mul_(init_scale)
        self.head.bias.data.mul_(init_scale)

    @staticmethod
    def _init_weights(m):
        if isinstance(m, nn.Linear):
            trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)

    def get_num_layers(self):
        return len(self.blocks)

    def no_weight_decay(self):
        return {"pos_embed", "cls_token"}

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = x + self.pos_embed.type_as(x)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.fc_norm(x.mean(1)))


def layer_id_for(name, num_layers):
    if name.startswith("patch_embed") or name in ("cls_token", "pos_embed"):
        return 0
    if name.startswith("blocks."):
        return int(name.split(".")[1]) + 1
    return num_layers + 1


def param_groups_lrd(model, weight_decay, skip_list, num_layers, layer_decay):
    scales = [layer_decay ** (num_layers + 1 - i) for i in range(num_layers + 2)]
    groups = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        no_decay = p.ndim == 1 or name.endswith(".bias") or name in skip_list
        lid = layer_id_for(name, num_layers)
        key = f"layer_{lid}_{'no_decay' if no_decay else 'decay'}"
        if key not in groups:
            groups[key] = {"params": [], "weight_decay": 0.0 if no_decay else weight_decay,
                           "lr_scale": scales[lid]}
        groups[key]["params"].append(p)
    return list(groups.values())


# ------------------------------------------------------------------ data
def read_list(path, root):
    samples = []
    with open(path) as f:
        for line in f:
            rel, label = line.strip().rsplit(" ", 1)
            samples.append((os.path.join(root, rel), int(label)))
    return samples


MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1, 1)


class VideoClsDataset(Dataset):
    def __init__(self, samples, num_frames, rate, size, mode, num_segment=1, num_crop=1):
        self.samples, self.num_frames, self.rate, self.size, self.mode = samples, num_frames, rate, size, mode
        self.num_segment, self.num_crop = num_segment, num_crop

    def __len__(self):
        return len(self.samples) * self.num_segment * self.num_crop

    def __getitem__(self, index):
        vid, view = divmod(index, self.num_segment * self.num_crop)
        seg, crop = divmod(view, self.num_crop)
        path, label = self.samples[vid]
        vr = VideoReader(path, num_threads=1, ctx=cpu(0))
        n, span = len(vr), self.num_frames * self.rate
        if self.mode == "train":
            start = random.randint(0, max(n - span, 0))
        else:
            start = int(max(n - span, 0) * seg / max(self.num_segment - 1, 1))
        idx = np.clip(np.arange(start, start + span, self.rate), 0, n - 1)
        x = torch.from_numpy(vr.get_batch(idx).asnumpy()).float().div(255).permute(0, 3, 1, 2)
        h, w = x.shape[-2:]
        if self.mode == "train":
            area = h * w * random.uniform(0.08, 1.0)
            ratio = math.exp(random.uniform(math.log(3 / 4), math.log(4 / 3)))
            ch = min(h, int(round(math.sqrt(area / ratio))))
            cw = min(w, int(round(math.sqrt(area * ratio))))
            i, j = random.randint(0, h - ch), random.randint(0, w - cw)
            x = F.interpolate(x[..., i:i + ch, j:j + cw], size=(self.size, self.size),
                              mode="bilinear", align_corners=False)
            if random.random() < 0.5:
                x = x.flip(-1)
        else:
            s = self.size / min(h, w)
            x = F.interpolate(x, size=(max(self.size, round(h * s)), max(self.size, round(w * s))),
                              mode="bilinear", align_corners=False)
            h, w = x.shape[-2:]
            k = crop if self.num_crop > 1 else 1
            i = (h - self.size) * k // 2 if h > w else (h - self.size) // 2
            j = (w - self.size) * k // 2 if w >= h else (w - self.size) // 2
            x = x[..., i:i + self.size, j:j + self.size]
        x = (x.permute(1, 0, 2, 3) - MEAN) / STD
        return x, label, vid


class DistEvalSampler(Sampler):
    def __init__(self, length, num_replicas, rank):
        self.indices = range(rank, length, num_replicas)

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


@torch.no_grad()
def final_test(model, loader, num_videos, num_classes, device):
    model.eval()
    scores = torch.zeros(num_videos, num_classes, device=device)
    views = torch.zeros(num_videos, device=device)
    targets = torch.zeros(num_videos, dtype=torch.long, device=device)
    for videos, target, vid in loader:
        videos = videos.to(device, non_blocking=True)
        vid, target = vid.to(device), target.to(device)
        with torch.cuda.amp.autocast():
            out = model(videos)
        scores.index_add_(0, vid, out.float().softmax(-1))
        views.index_add_(0, vid, torch.ones(len(vid), device=device))
        targets.index_copy_(0, vid, target)
    for t in (scores, views, targets):
        dist.all_reduce(t, op=dist.ReduceOp.SUM if t is not targets else dist.ReduceOp.MAX)
    pred = scores / views.clamp(min=1).unsqueeze(1)
    acc1 = (pred.argmax(1) == targets).float().mean().item() * 100
    acc5 = (pred.topk(5, 1).indices == targets[:, None]).any(1).float().mean().item() * 100
    return acc1, acc5


def cosine_scheduler(base, final, epochs, niter_per_ep, warmup_epochs):
    warmup_iters = warmup_epochs * niter_per_ep
    warmup = np.linspace(0, base, warmup_iters)
    iters = np.arange(epochs * niter_per_ep - warmup_iters)
    cosine = final + 0.5 * (base - final) * (1 + np.cos(np.pi * iters / len(iters)))
    return np.concatenate((warmup, cosine))


def main(args):
    args.gpu = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(args.gpu)
    dist.init_process_group(backend="nccl", timeout=datetime.timedelta(minutes=60))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.gpu)
    seed = args.seed + rank
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)

    train_samples = read_list(os.path.join(args.data_path, "train.csv"), args.data_root)
    val_samples = read_list(os.path.join(args.data_path, "val.csv"), args.data_root)
    dataset_train = VideoClsDataset(train_samples, args.num_frames, args.sampling_rate, args.input_size, "train")
    dataset_test = VideoClsDataset(val_samples, args.num_frames, args.sampling_rate, args.input_size, "test",
                                   args.test_num_segment, args.test_num_crop)
    sampler_train = DistributedSampler(dataset_train, num_replicas=world_size, rank=rank, shuffle=True)
    loader_train = DataLoader(dataset_train, sampler=sampler_train, batch_size=args.batch_size,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    loader_test = DataLoader(dataset_test, sampler=DistEvalSampler(len(dataset_test), world_size, rank),
                             batch_size=args.batch_size, num_workers=args.num_workers, pin_memory=True)

    mixup_fn = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, label_smoothing=args.smoothing,
                     num_classes=args.nb_classes)

    model = VideoViT(num_classes=args.nb_classes, num_frames=args.num_frames, drop_path_rate=args.drop_path)
    if args.finetune:
        checkpoint = torch.load(args.finetune, map_location="cpu")
        checkpoint_model = checkpoint.get("model", checkpoint.get("module", checkpoint))
        new_dict = {}
        for k, v in checkpoint_model.items():
            if k.startswith("encoder."):
                new_dict[k[len("encoder."):]] = v
            elif not k.startswith("decoder") and not k.startswith("head"):
                new_dict[k] = v
        msg = model.load_state_dict(new_dict, strict=False)
        if rank == 0:
            print("load pretrained:", msg)
    model.to(device)
    model = DDP(model, device_ids=[args.gpu])
    model_without_ddp = model.module

    total_batch_size = args.batch_size * world_size
    args.lr = args.blr * total_batch_size / 256
    num_layers = model.get_num_layers()
    skip_weight_decay_list = model.no_weight_decay()
    param_groups = param_groups_lrd(model_without_ddp, args.weight_decay, skip_weight_decay_list,
                                    num_layers, args.layer_decay)
    optimizer = torch.optim.AdamW(param_groups, lr=args.lr, betas=(0.9, 0.999))
    loss_scaler = torch.cuda.amp.GradScaler()
    criterion = SoftTargetCrossEntropy() if mixup_fn is not None else LabelSmoothingCrossEntropy(args.smoothing)

    niter_per_ep = len(loader_train)
    lr_schedule = cosine_scheduler(args.lr, args.min_lr, args.epochs, niter_per_ep, args.warmup_epochs)
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"lr {args.lr:.2e}, batch {total_batch_size}, {niter_per_ep} iters/epoch", flush=True)

    start_time = time.time()
    for epoch in range(args.epochs):
        sampler_train.set_epoch(epoch)
        model.train()
        loss_sum = torch.zeros(2, device=device)
        for it, (samples, targets, _) in enumerate(loader_train):
            gstep = epoch * niter_per_ep + it
            for g in optimizer.param_groups:
                g["lr"] = lr_schedule[gstep] * g["lr_scale"]
            samples = samples.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            samples, targets = mixup_fn(samples, targets)
            with torch.cuda.amp.autocast():
                loss = criterion(model(samples), targets)
            optimizer.zero_grad()
            loss_scaler.scale(loss).backward()
            if args.clip_grad is not None:
                loss_scaler.unscale_(optimizer)
                nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
            loss_scaler.step(optimizer)
            loss_scaler.update()
            loss_sum[0] += loss.detach()
            loss_sum[1] += 1
            if rank == 0 and it % 50 == 0:
                print(f"Epoch [{epoch}] [{it}/{niter_per_ep}] loss {loss.item():.4f} "
                      f"lr {lr_schedule[gstep]:.2e}", flush=True)
        dist.all_reduce(loss_sum)
        if rank == 0:
            log = {"epoch": epoch, "train_loss": (loss_sum[0] / loss_sum[1]).item()}
            with open(os.path.join(args.output_dir, "log.txt"), "a") as f:
                f.write(json.dumps(log) + "\n")
            if (epoch + 1) % 10 == 0 or epoch + 1 == args.epochs:
                torch.save({"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                            "scaler": loss_scaler.state_dict(), "epoch": epoch, "args": vars(args)},
                           os.path.join(args.output_dir, f"checkpoint-{epoch}.pth"))

    acc1, acc5 = final_test(model_without_ddp, loader_test, len(val_samples), args.nb_classes, device)
    if rank == 0:
        print(f"{args.test_num_segment}x{args.test_num_crop} test: top1 {acc1:.2f} top5 {acc5:.2f}")
        print("training time", str(datetime.timedelta(seconds=int(time.time() - start_time))))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(get_args())
