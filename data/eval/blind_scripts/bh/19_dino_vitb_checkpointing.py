"""DINO ViT-B/16 pre-training with activation checkpointing in the student to fit
64 images x (2 global + 10 local crops) per 40 GB GPU.

    torchrun --nproc_per_node=8 19_dino_vitb_checkpointing.py --data /data/imagenet/train --out exp/dino_vitb16
"""
import argparse
import math
import os
import time
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from torchvision import datasets, transforms
from torchvision.transforms import InterpolationMode


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--patch-size", type=int, default=16)
    ap.add_argument("--out-dim", type=int, default=65536)
    ap.add_argument("--batch-size-per-gpu", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=400)
    ap.add_argument("--lr", type=float, default=7.5e-4)
    ap.add_argument("--min-lr", type=float, default=2e-6)
    ap.add_argument("--warmup-epochs", type=int, default=10)
    ap.add_argument("--wd", type=float, default=0.04)
    ap.add_argument("--wd-end", type=float, default=0.4)
    ap.add_argument("--momentum-teacher", type=float, default=0.996)
    ap.add_argument("--teacher-temp", type=float, default=0.07)
    ap.add_argument("--local-crops", type=int, default=10)
    ap.add_argument("--drop-path", type=float, default=0.1)
    ap.add_argument("--clip-grad", type=float, default=0.3)
    ap.add_argument("--grad-checkpointing", type=int, default=1)
    ap.add_argument("--workers", type=int, default=10)
    return ap.parse_args()


class DropPath(nn.Module):
    def __init__(self, p=0.0):
        super().__init__()
        self.p = p

    def forward(self, x):
        if self.p == 0.0 or not self.training:
            return x
        keep = 1 - self.p
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
        return x * mask / keep


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        x = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        return self.proj(x.transpose(1, 2).reshape(B, N, C))


class Block(nn.Module):
    def __init__(self, dim, heads, drop_path):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, heads)
        self.drop_path = DropPath(drop_path)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.drop_path(self.attn(self.norm1(x)))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class VisionTransformer(nn.Module):
    def __init__(self, patch_size=16, dim=768, depth=12, heads=12, drop_path=0.0, grad_checkpointing=False):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch_size, patch_size)
        self.patch_size = patch_size
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, 1 + (224 // patch_size) ** 2, dim))
        dpr = np.linspace(0, drop_path, depth)
        self.blocks = nn.ModuleList([Block(dim, heads, dpr[i]) for i in range(depth)])
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.embed_dim = dim
        self.grad_checkpointing = grad_checkpointing
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)

    def interpolate_pos_encoding(self, x, w, h):
        npatch, N = x.shape[1] - 1, self.pos_embed.shape[1] - 1
        if npatch == N and w == h:
            return self.pos_embed
        cls_pos, patch_pos = self.pos_embed[:, :1], self.pos_embed[:, 1:]
        gs = int(math.sqrt(N))
        patch_pos = F.interpolate(patch_pos.reshape(1, gs, gs, -1).permute(0, 3, 1, 2),
                                  size=(h // self.patch_size, w // self.patch_size), mode="bicubic",
                                  align_corners=False)
        return torch.cat((cls_pos, patch_pos.permute(0, 2, 3, 1).flatten(1, 2)), dim=1)

    def forward(self, x):
        B, _, h, w = x.shape
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat((self.cls_token.expand(B, -1, -1), x), dim=1)
        x = x + self.interpolate_pos_encoding(x, w, h)
        for blk in self.blocks:
            if self.grad_checkpointing and self.training:
                x = torch.utils.checkpoint.checkpoint(blk, x)
            else:
                x = blk(x)
        return self.norm(x)[:, 0]


class DINOHead(nn.Module):
    def __init__(self, in_dim, out_dim, hidden=2048, bottleneck=256):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(in_dim, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                                 nn.Linear(hidden, bottleneck))
        self.last_layer = nn.utils.weight_norm(nn.Linear(bottleneck, out_dim, bias=False))
        self.last_layer.weight_g.data.fill_(1)
        self.last_layer.weight_g.requires_grad = False

    def forward(self, x):
        return self.last_layer(F.normalize(self.mlp(x), dim=-1))


class MultiCropWrapper(nn.Module):
    def __init__(self, backbone, head):
        super().__init__()
        self.backbone, self.head = backbone, head

    def forward(self, crops):
        res = [c.shape[-1] for c in crops]
        counts = torch.unique_consecutive(torch.tensor(res), return_counts=True)[1]
        outs, start = [], 0
        for end in torch.cumsum(counts, 0).tolist():
            outs.append(self.backbone(torch.cat(crops[start:end])))
            start = end
        return self.head(torch.cat(outs))


class DINOLoss(nn.Module):
    def __init__(self, out_dim, ncrops, teacher_temp, epochs, warmup_temp=0.04, warmup_temp_epochs=30):
        super().__init__()
        self.ncrops = ncrops
        self.register_buffer("center", torch.zeros(1, out_dim))
        self.temps = np.concatenate((np.linspace(warmup_temp, teacher_temp, warmup_temp_epochs),
                                     np.ones(epochs - warmup_temp_epochs) * teacher_temp))

    def forward(self, s, t, epoch):
        s = (s / 0.1).chunk(self.ncrops)
        tq = F.softmax((t - self.center) / self.temps[epoch], dim=-1).detach().chunk(2)
        total, n = 0.0, 0
        for i, q in enumerate(tq):
            for v in range(self.ncrops):
                if v != i:
                    total = total + (-q * F.log_softmax(s[v], dim=-1)).sum(-1).mean()
                    n += 1
        with torch.no_grad():
            c = t.sum(0, keepdim=True)
            dist.all_reduce(c)
            self.center.mul_(0.9).add_(c / (t.shape[0] * dist.get_world_size()), alpha=0.1)
        return total / n


class Crops:
    def __init__(self, n_local):
        fc = transforms.Compose([transforms.RandomHorizontalFlip(),
                                 transforms.RandomApply([transforms.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8),
                                 transforms.RandomGrayscale(p=0.2)])
        norm = transforms.Compose([transforms.ToTensor(),
                                   transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
        blur = transforms.GaussianBlur(23, (0.1, 2.0))
        rrc = partial(transforms.RandomResizedCrop, interpolation=InterpolationMode.BICUBIC)
        self.g1 = transforms.Compose([rrc(224, scale=(0.25, 1.0)), fc, blur, norm])
        self.g2 = transforms.Compose([rrc(224, scale=(0.25, 1.0)), fc, transforms.RandomApply([blur], p=0.1),
                                      transforms.RandomSolarize(128, p=0.2), norm])
        self.lc = transforms.Compose([rrc(96, scale=(0.05, 0.25)), fc, transforms.RandomApply([blur], p=0.5), norm])
        self.n_local = n_local

    def __call__(self, img):
        return [self.g1(img), self.g2(img)] + [self.lc(img) for _ in range(self.n_local)]


def cosine(base, final, epochs, niter, warmup=0):
    w = np.linspace(0, base, warmup * niter) if warmup else np.array([])
    it = np.arange(epochs * niter - len(w))
    return np.concatenate((w, final + 0.5 * (base - final) * (1 + np.cos(np.pi * it / len(it)))))


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    ds = datasets.ImageFolder(args.data, transform=Crops(args.local_crops))
    sampler = torch.utils.data.DistributedSampler(ds, shuffle=True)
    loader = torch.utils.data.DataLoader(ds, sampler=sampler, batch_size=args.batch_size_per_gpu,
                                         num_workers=args.workers, pin_memory=True, drop_last=True)

    student = MultiCropWrapper(VisionTransformer(args.patch_size, drop_path=args.drop_path,
                                                 grad_checkpointing=bool(args.grad_checkpointing)),
                               DINOHead(768, args.out_dim)).cuda()
    teacher = MultiCropWrapper(VisionTransformer(args.patch_size), DINOHead(768, args.out_dim)).cuda()
    student = nn.parallel.DistributedDataParallel(student, device_ids=[local_rank])
    teacher.load_state_dict(student.module.state_dict())
    teacher.requires_grad_(False)

    loss_fn = DINOLoss(args.out_dim, 2 + args.local_crops, args.teacher_temp, args.epochs).cuda()
    decay = [p for n, p in student.named_parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for n, p in student.named_parameters() if p.requires_grad and p.ndim <= 1]
    optimizer = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}])

    niter = len(loader)
    lr_s = cosine(args.lr * args.batch_size_per_gpu * world / 256, args.min_lr, args.epochs, niter,
                  args.warmup_epochs)
    wd_s = cosine(args.wd, args.wd_end, args.epochs, niter)
    m_s = cosine(args.momentum_teacher, 1.0, args.epochs, niter)

    ckpt_path = os.path.join(args.out, "checkpoint.pth")
    start_epoch = 0
    if os.path.isfile(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        student.module.load_state_dict(ck["student"])
        teacher.load_state_dict(ck["teacher"])
        optimizer.load_state_dict(ck["optimizer"])
        loss_fn.load_state_dict(ck["loss"])
        start_epoch = ck["epoch"]
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        student.train()
        tic = time.time()
        for it, (crops, _) in enumerate(loader):
            gi = epoch * niter + it
            optimizer.param_groups[0]["lr"] = optimizer.param_groups[1]["lr"] = lr_s[gi]
            optimizer.param_groups[0]["weight_decay"] = wd_s[gi]
            crops = [c.cuda(non_blocking=True) for c in crops]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                with torch.no_grad():
                    t_out = teacher(crops[:2])
                s_out = student(crops)
            loss = loss_fn(s_out.float(), t_out.float(), epoch)

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(student.parameters(), args.clip_grad)
            if epoch == 0:
                for n, p in student.named_parameters():
                    if "last_layer" in n:
                        p.grad = None
            optimizer.step()

            with torch.no_grad():
                m = m_s[gi]
                for ps, pt in zip(student.module.parameters(), teacher.parameters()):
                    pt.mul_(m).add_(ps.detach(), alpha=1 - m)

            if it % 50 == 0:
                lv = loss.detach()
                dist.all_reduce(lv, op=dist.ReduceOp.AVG)
                if rank == 0:
                    mem = torch.cuda.max_memory_allocated() / 2 ** 30
                    print(f"[{epoch}] {it}/{niter} loss {lv.item():.4f} lr {lr_s[gi]:.2e} m {m:.4f} "
                          f"mem {mem:.1f}G {(time.time() - tic) / (it + 1):.2f}s/it", flush=True)

        if rank == 0:
            torch.save({"student": student.module.state_dict(), "teacher": teacher.state_dict(),
                        "optimizer": optimizer.state_dict(), "loss": loss_fn.state_dict(), "epoch": epoch + 1},
                       ckpt_path)
            if (epoch + 1) % 50 == 0:
                torch.save(teacher.backbone.state_dict(), os.path.join(args.out, f"teacher_vitb_{epoch + 1}.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
