# Fine-tune VideoMAE ViT-S/16 on Kinetics-400 with layer-wise lr decay.
#   torchrun --nproc_per_node=8 05_videomae_ft_layer_decay.py --data_root /data/k400 \
#       --finetune pretrain/videomae_vit_s_k400_1600e.pth --output_dir out/vit_s_k400
import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from decord import VideoReader, cpu
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_root", required=True)
    p.add_argument("--finetune", default="")
    p.add_argument("--output_dir", default="out/vit_s_k400")
    p.add_argument("--nb_classes", type=int, default=400)
    p.add_argument("--num_frames", type=int, default=16)
    p.add_argument("--sampling_rate", type=int, default=4)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--epochs", type=int, default=150)
    p.add_argument("--warmup_epochs", type=int, default=15)
    p.add_argument("--blr", type=float, default=1e-3)
    p.add_argument("--min_lr", type=float, default=1e-6)
    p.add_argument("--weight_decay", type=float, default=0.05)
    p.add_argument("--layer_decay", type=float, default=0.7)
    p.add_argument("--drop_path", type=float, default=0.1)
    p.add_argument("--num_workers", type=int, default=8)
    p.add_argument("--eval_freq", type=int, default=10)
    return p.parse_args()


class Attention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(dim))
        self.v_bias = nn.Parameter(torch.zeros(dim))
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        bias = torch.cat([self.q_bias, torch.zeros_like(self.v_bias), self.v_bias])
        qkv = F.linear(x, self.qkv.weight, bias).reshape(B, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        x = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        return self.proj(x.transpose(1, 2).reshape(B, N, C))


class Block(nn.Module):
    def __init__(self, dim, num_heads, dp):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim, eps=1e-6), nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.dp = dp

    def drop_path(self, x):
        if not self.training or self.dp == 0:
            return x
        mask = torch.empty(x.shape[0], 1, 1, device=x.device).bernoulli_(1 - self.dp)
        return x * mask / (1 - self.dp)

    def forward(self, x):
        x = x + self.drop_path(self.attn(self.norm1(x)))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class VisionTransformer(nn.Module):
    def __init__(self, num_classes, num_frames=16, embed_dim=384, depth=12, num_heads=6, drop_path_rate=0.1):
        super().__init__()
        self.patch_embed = nn.Conv3d(3, embed_dim, kernel_size=(2, 16, 16), stride=(2, 16, 16))
        num_patches = (num_frames // 2) * 14 * 14
        pos = np.arange(num_patches)[:, None] / np.power(10000, 2 * (np.arange(embed_dim) // 2) / embed_dim)
        pos[:, 0::2], pos[:, 1::2] = np.sin(pos[:, 0::2]), np.cos(pos[:, 1::2])
        self.register_buffer("pos_embed", torch.from_numpy(pos).float()[None], persistent=False)
        dpr = np.linspace(0, drop_path_rate, depth)
        self.blocks = nn.ModuleList([Block(embed_dim, num_heads, float(dpr[i])) for i in range(depth)])
        self.fc_norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.head = nn.Linear(embed_dim, num_classes)
        nn.init.trunc_normal_(self.head.weight, std=2e-5)
        nn.init.zeros_(self.head.bias)

    def get_num_layers(self):
        return len(self.blocks)

    @torch.jit.ignore
    def no_weight_decay(self):
        return {"pos_embed", "cls_token"}

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2) + self.pos_embed
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.fc_norm(x.mean(1)))


def layer_id_for_vit(name, num_layers):
    if name.startswith("patch_embed"):
        return 0
    if name.startswith("blocks."):
        return int(name.split(".")[1]) + 1
    return num_layers + 1


def build_param_groups(model, num_layers, skip_list, weight_decay, layer_decay):
    scales = [layer_decay ** (num_layers + 1 - i) for i in range(num_layers + 2)]
    groups = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        name = name[len("module."):] if name.startswith("module.") else name
        no_wd = param.ndim == 1 or name in skip_list
        lid = layer_id_for_vit(name, num_layers)
        g = groups.setdefault((lid, no_wd), {"params": [], "weight_decay": 0.0 if no_wd else weight_decay,
                                             "lr_scale": scales[lid]})
        g["params"].append(param)
    return list(groups.values())


class KineticsDense(Dataset):
    def __init__(self, root, split, num_frames, rate):
        self.root, self.split, self.num_frames, self.rate = root, split, num_frames, rate
        with open(os.path.join(root, "annotations", f"{split}.csv")) as f:
            rows = [l.strip().split(",") for l in f if l.strip()]
        self.samples = [(r[0], int(r[1])) for r in rows]

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        path, label = self.samples[i]
        vr = VideoReader(os.path.join(self.root, self.split, path), num_threads=1, ctx=cpu(0))
        n, span = len(vr), self.num_frames * self.rate
        if self.split == "train":
            start = np.random.randint(0, max(1, n - span))
        else:
            start = max(0, n - span) // 2
        idx = np.minimum(np.arange(start, start + span, self.rate), n - 1)
        x = torch.from_numpy(vr.get_batch(idx).asnumpy()).permute(3, 0, 1, 2).float().div_(255)
        h, w = x.shape[-2:]
        if self.split == "train":
            area = h * w * np.random.uniform(0.08, 1.0)
            ratio = math.exp(np.random.uniform(math.log(3 / 4), math.log(4 / 3)))
            ch = min(h, int(round(math.sqrt(area / ratio))))
            cw = min(w, int(round(math.sqrt(area * ratio))))
            top, left = np.random.randint(0, h - ch + 1), np.random.randint(0, w - cw + 1)
            x = F.interpolate(x[..., top:top + ch, left:left + cw], size=(224, 224), mode="bilinear")
            if np.random.rand() < 0.5:
                x = x.flip(-1)
        else:
            s = 224 / min(h, w)
            x = F.interpolate(x, size=(max(224, round(h * s)), max(224, round(w * s))), mode="bilinear")
            h, w = x.shape[-2:]
            x = x[..., (h - 224) // 2:(h + 224) // 2, (w - 224) // 2:(w + 224) // 2]
        mean = x.new_tensor([0.485, 0.456, 0.406]).view(3, 1, 1, 1)
        std = x.new_tensor([0.229, 0.224, 0.225]).view(3, 1, 1, 1)
        return (x - mean) / std, label


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    meter = torch.zeros(3, dtype=torch.float64, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.cuda.amp.autocast():
            logits = model(x)
        top5 = logits.topk(5, -1).indices
        meter[0] += (top5[:, 0] == y).sum()
        meter[1] += (top5 == y.unsqueeze(1)).any(-1).sum()
        meter[2] += y.shape[0]
    dist.all_reduce(meter)
    return (meter[:2] / meter[2] * 100).tolist()


def main(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda")
    seed = 0 + rank
    torch.manual_seed(seed)
    np.random.seed(seed)

    model = VisionTransformer(args.nb_classes, args.num_frames, drop_path_rate=args.drop_path)
    if args.finetune:
        checkpoint = torch.load(args.finetune, map_location="cpu")
        state = checkpoint["model"] if "model" in checkpoint else checkpoint["module"]
        state = {k.replace("encoder.", ""): v for k, v in state.items()
                 if k.startswith("encoder.") and not k.startswith("encoder.norm.")}
        print(model.load_state_dict(state, strict=False)) if rank == 0 else None
    model.to(device)
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])

    num_layers = model.get_num_layers()
    skip_weight_decay_list = model.no_weight_decay()
    optimizer = torch.optim.AdamW(
        build_param_groups(model, num_layers, skip_weight_decay_list, args.weight_decay, args.layer_decay),
        lr=args.blr, betas=(0.9, 0.999))

    train_set = KineticsDense(args.data_root, "train", args.num_frames, args.sampling_rate)
    val_set = KineticsDense(args.data_root, "val", args.num_frames, args.sampling_rate)
    sampler_train = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    loader_train = DataLoader(train_set, sampler=sampler_train, batch_size=args.batch_size,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    val_idx = np.array_split(np.arange(len(val_set)), world_size)[rank]
    loader_val = DataLoader(torch.utils.data.Subset(val_set, val_idx.tolist()), batch_size=args.batch_size,
                            num_workers=args.num_workers, pin_memory=True)

    eff_batch = args.batch_size * world_size
    lr = args.blr * eff_batch / 256
    steps_per_epoch = len(loader_train)
    warmup, total = args.warmup_epochs * steps_per_epoch, args.epochs * steps_per_epoch
    scaler = torch.cuda.amp.GradScaler()
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"eff batch {eff_batch}, lr {lr:.3e}, {steps_per_epoch} steps/epoch")

    max_acc = 0.0
    for epoch in range(args.epochs):
        sampler_train.set_epoch(epoch)
        model.train()
        start = time.time()
        for it, (samples, targets) in enumerate(loader_train):
            step = epoch * steps_per_epoch + it
            cur_lr = lr * step / warmup if step < warmup else \
                args.min_lr + (lr - args.min_lr) * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))
            for g in optimizer.param_groups:
                g["lr"] = cur_lr * g["lr_scale"]
            samples, targets = samples.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            with torch.cuda.amp.autocast():
                loss = criterion(model(samples), targets)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if rank == 0 and it % 50 == 0:
                print(f"Epoch {epoch} [{it}/{steps_per_epoch}] loss {loss.item():.4f} lr {cur_lr:.2e} "
                      f"{(time.time() - start) / (it + 1):.2f}s/it", flush=True)

        if (epoch + 1) % args.eval_freq == 0 or epoch + 1 == args.epochs:
            acc1, acc5 = evaluate(model.module, loader_val, device)
            if rank == 0:
                max_acc = max(max_acc, acc1)
                with open(os.path.join(args.output_dir, "log.txt"), "a") as f:
                    f.write(json.dumps({"epoch": epoch, "val_acc1": acc1, "val_acc5": acc5}) + "\n")
                print(f"Accuracy of the network on the val videos: {acc1:.1f}% (max {max_acc:.2f}%)")
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch},
                       os.path.join(args.output_dir, "checkpoint-last.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main(get_args())
