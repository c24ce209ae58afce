"""DINO ViT-B/8 pre-training.  ViT-B/8 at 224px is memory hungry, so the transformer blocks
are activation-checkpointed to fit 32 images (2 global + 10 local crops each) per 40GB GPU."""
import argparse
import json
import math
import os
import random
import time
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from timm.layers import trunc_normal_
from timm.models.vision_transformer import Block
from torchvision import datasets, transforms as T


def args_parser():
    p = argparse.ArgumentParser("DINO ViT-B/8")
    p.add_argument("--data_path", default="/data/imagenet/train")
    p.add_argument("--output_dir", default="./dino_vitb8")
    p.add_argument("--patch_size", default=8, type=int)
    p.add_argument("--out_dim", default=65536, type=int)
    p.add_argument("--batch_size_per_gpu", default=32, type=int)
    p.add_argument("--epochs", default=300, type=int)
    p.add_argument("--lr", default=5e-4, type=float)
    p.add_argument("--min_lr", default=2e-6, type=float)
    p.add_argument("--warmup_epochs", default=10, type=int)
    p.add_argument("--weight_decay", default=0.04, type=float)
    p.add_argument("--weight_decay_end", default=0.4, type=float)
    p.add_argument("--momentum_teacher", default=0.996, type=float)
    p.add_argument("--teacher_temp", default=0.07, type=float)
    p.add_argument("--warmup_teacher_temp", default=0.03, type=float)
    p.add_argument("--warmup_teacher_temp_epochs", default=50, type=int)
    p.add_argument("--local_crops_number", default=10, type=int)
    p.add_argument("--clip_grad", default=3.0, type=float)
    p.add_argument("--grad_checkpointing", default=1, type=int)
    p.add_argument("--num_workers", default=10, type=int)
    p.add_argument("--saveckp_freq", default=20, type=int)
    return p.parse_args()


class PatchEmbed(nn.Module):
    def __init__(self, patch_size=16, in_chans=3, embed_dim=768):
        super().__init__()
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class ViT(nn.Module):
    def __init__(self, img_size=224, patch_size=16, embed_dim=768, depth=12, num_heads=12, drop_path_rate=0.,
                 use_checkpoint=False):
        super().__init__()
        self.patch_size = patch_size
        self.patch_embed = PatchEmbed(patch_size, 3, embed_dim)
        num_patches = (img_size // patch_size) ** 2
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, embed_dim))
        dpr = [x.item() for x in torch.linspace(0, drop_path_rate, depth)]
        self.blocks = nn.ModuleList([Block(embed_dim, num_heads, 4.0, qkv_bias=True, drop_path=dpr[i],
                                           norm_layer=partial(nn.LayerNorm, eps=1e-6)) for i in range(depth)])
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.embed_dim = embed_dim
        self.use_checkpoint = use_checkpoint
        trunc_normal_(self.pos_embed, std=.02)
        trunc_normal_(self.cls_token, std=.02)

    def interpolate_pos_encoding(self, x, w, h):
        npatch = x.shape[1] - 1
        N = self.pos_embed.shape[1] - 1
        if npatch == N and w == h:
            return self.pos_embed
        class_pos_embed = self.pos_embed[:, 0]
        patch_pos_embed = self.pos_embed[:, 1:]
        dim = x.shape[-1]
        w0, h0 = w // self.patch_size + 0.1, h // self.patch_size + 0.1
        patch_pos_embed = F.interpolate(
            patch_pos_embed.reshape(1, int(math.sqrt(N)), int(math.sqrt(N)), dim).permute(0, 3, 1, 2),
            scale_factor=(w0 / math.sqrt(N), h0 / math.sqrt(N)), mode="bicubic")
        patch_pos_embed = patch_pos_embed.permute(0, 2, 3, 1).view(1, -1, dim)
        return torch.cat((class_pos_embed.unsqueeze(0), patch_pos_embed), dim=1)

    def forward(self, x):
        B, nc, w, h = x.shape
        x = self.patch_embed(x)
        x = torch.cat((self.cls_token.expand(B, -1, -1), x), dim=1)
        x = x + self.interpolate_pos_encoding(x, w, h)
        for blk in self.blocks:
            if self.use_checkpoint and x.requires_grad:
                x = torch.utils.checkpoint.checkpoint(blk, x)
            else:
                x = blk(x)
        return self.norm(x)[:, 0]


class DINOHead(nn.Module):
    def __init__(self, in_dim, out_dim, hidden_dim=2048, bottleneck_dim=256):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(in_dim, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, hidden_dim),
                                 nn.GELU(), nn.Linear(hidden_dim, bottleneck_dim))
        self.last_layer = nn.utils.weight_norm(nn.Linear(bottleneck_dim, out_dim, bias=False))
        self.last_layer.weight_g.data.fill_(1)
        self.last_layer.weight_g.requires_grad = False

    def forward(self, x):
        return self.last_layer(F.normalize(self.mlp(x), dim=-1))


class MultiCropWrapper(nn.Module):
    def __init__(self, backbone, head):
        super().__init__()
        self.backbone, self.head = backbone, head

    def forward(self, x):
        sizes = torch.tensor([inp.shape[-1] for inp in x])
        idx_crops = torch.cumsum(torch.unique_consecutive(sizes, return_counts=True)[1], 0)
        start, feats = 0, []
        for end in idx_crops:
            feats.append(self.backbone(torch.cat(x[start:end])))
            start = end
        return self.head(torch.cat(feats))


class DINOLoss(nn.Module):
    def __init__(self, out_dim, ncrops, warmup_t, t, warmup_ep, nepochs, student_temp=0.1, center_momentum=0.9):
        super().__init__()
        self.student_temp, self.center_momentum, self.ncrops = student_temp, center_momentum, ncrops
        self.register_buffer("center", torch.zeros(1, out_dim))
        self.tt = np.concatenate((np.linspace(warmup_t, t, warmup_ep), np.ones(nepochs - warmup_ep) * t))

    def forward(self, s_out, t_out, epoch):
        s = (s_out / self.student_temp).chunk(self.ncrops)
        t = F.softmax((t_out - self.center) / self.tt[epoch], dim=-1).detach().chunk(2)
        loss, n = 0, 0
        for iq, q in enumerate(t):
            for v in range(len(s)):
                if v != iq:
                    loss = loss + torch.sum(-q * F.log_softmax(s[v], dim=-1), dim=-1).mean()
                    n += 1
        with torch.no_grad():
            bc = t_out.sum(0, keepdim=True)
            dist.all_reduce(bc)
            bc = bc / (len(t_out) * dist.get_world_size())
            self.center = self.center * self.center_momentum + bc * (1 - self.center_momentum)
        return loss / n


def multicrop_transform(n_local):
    fc = T.Compose([T.RandomHorizontalFlip(), T.RandomApply([T.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8),
                    T.RandomGrayscale(0.2)])
    nrm = T.Compose([T.ToTensor(), T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    blur = lambda p: T.RandomApply([T.GaussianBlur(23, (0.1, 2.0))], p=p)
    g1 = T.Compose([T.RandomResizedCrop(224, (0.25, 1.0), interpolation=3), fc, blur(1.0), nrm])
    g2 = T.Compose([T.RandomResizedCrop(224, (0.25, 1.0), interpolation=3), fc, blur(0.1),
                    T.RandomSolarize(128, 0.2), nrm])
    lc = T.Compose([T.RandomResizedCrop(96, (0.05, 0.25), interpolation=3), fc, blur(0.5), nrm])
    return lambda img: [g1(img), g2(img)] + [lc(img) for _ in range(n_local)]


def cosine(base, final, epochs, niter, warmup=0):
    w = np.linspace(0, base, warmup * niter)
    it = np.arange(epochs * niter - len(w))
    return np.concatenate((w, final + 0.5 * (base - final) * (1 + np.cos(np.pi * it / len(it)))))


def main():
    args = args_parser()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    random.seed(rank)

    ds = datasets.ImageFolder(args.data_path, transform=multicrop_transform(args.local_crops_number))
    sampler = torch.utils.data.DistributedSampler(ds, shuffle=True)
    dl = torch.utils.data.DataLoader(ds, batch_size=args.batch_size_per_gpu, sampler=sampler,
                                     num_workers=args.num_workers, pin_memory=True, drop_last=True)

    vit = partial(ViT, patch_size=args.patch_size, embed_dim=768, depth=12, num_heads=12)
    student = MultiCropWrapper(vit(drop_path_rate=0.1, use_checkpoint=bool(args.grad_checkpointing)),
                               DINOHead(768, args.out_dim)).cuda()
    teacher = MultiCropWrapper(vit(), DINOHead(768, args.out_dim)).cuda()
    student = nn.parallel.DistributedDataParallel(student, device_ids=[local_rank])
    teacher.load_state_dict(student.module.state_dict())
    for p in teacher.parameters():
        p.requires_grad = False

    criterion = DINOLoss(args.out_dim, args.local_crops_number + 2, args.warmup_teacher_temp, args.teacher_temp,
                         args.warmup_teacher_temp_epochs, args.epochs).cuda()
    params = [p for p in student.parameters() if p.requires_grad]
    regularized = [p for p in params if p.ndim > 1]
    unregularized = [p for p in params if p.ndim <= 1]
    optimizer = torch.optim.AdamW([{"params": regularized}, {"params": unregularized, "weight_decay": 0.0}])
    scaler = torch.cuda.amp.GradScaler()

    niter = len(dl)
    lr_s = cosine(args.lr * args.batch_size_per_gpu * world / 256, args.min_lr, args.epochs, niter, args.warmup_epochs)
    wd_s = cosine(args.weight_decay, args.weight_decay_end, args.epochs, niter)
    m_s = cosine(args.momentum_teacher, 1.0, args.epochs, niter)

    ckpt_file = os.path.join(args.output_dir, "checkpoint.pth")
    start_epoch = 0
    if os.path.isfile(ckpt_file):
        ck = torch.load(ckpt_file, map_location="cpu")
        student.module.load_state_dict(ck["student"])
        teacher.load_state_dict(ck["teacher"])
        optimizer.load_state_dict(ck["optimizer"])
        scaler.load_state_dict(ck["scaler"])
        criterion.load_state_dict(ck["loss"])
        start_epoch = ck["epoch"]
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        student.train()
        t0, acc = time.time(), torch.zeros(2, device="cuda")
        for i, (crops, _) in enumerate(dl):
            it = epoch * niter + i
            for j, g in enumerate(optimizer.param_groups):
                g["lr"] = lr_s[it]
                if j == 0:
                    g["weight_decay"] = wd_s[it]
            crops = [c.cuda(non_blocking=True) for c in crops]
            with torch.cuda.amp.autocast():
                t_out = teacher(crops[:2])
                s_out = student(crops)
                loss = criterion(s_out, t_out, epoch)
            if not math.isfinite(loss.item()):
                raise RuntimeError(f"non-finite loss {loss.item()} at iteration {it}")
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(student.parameters(), args.clip_grad)
            scaler.step(optimizer)
            scaler.update()
            with torch.no_grad():
                m = m_s[it]
                for ps, pt in zip(student.module.parameters(), teacher.parameters()):
                    pt.mul_(m).add_(ps.detach(), alpha=1 - m)
            acc += torch.stack([loss.detach().float(), torch.ones((), device="cuda")])
            if rank == 0 and i % 50 == 0:
                print(f"[{epoch}][{i}/{niter}] loss {loss.item():.4f} lr {lr_s[it]:.2e} "
                      f"mem {torch.cuda.max_memory_allocated() / 2**30:.1f}G", flush=True)

        dist.all_reduce(acc)
        if rank == 0:
            log = {"epoch": epoch, "loss": (acc[0] / acc[1]).item(), "time": time.time() - t0}
            print(json.dumps(log), flush=True)
            with open(os.path.join(args.output_dir, "log.txt"), "a") as f:
                f.write(json.dumps(log) + "\n")
            sd = {"student": student.module.state_dict(), "teacher": teacher.state_dict(),
                  "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
                  "loss": criterion.state_dict(), "epoch": epoch + 1}
            torch.save(sd, ckpt_file)
            if epoch % args.saveckp_freq == 0:
                torch.save(sd, os.path.join(args.output_dir, f"checkpoint{epoch:04}.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
