# BEiT pre-training: masked image modeling with visual tokens from a frozen DALL-E dVAE.
import argparse
import glob
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
import torchvision.transforms as T
from dall_e import load_model, map_pixels
from timm.models.vision_transformer import Block, PatchEmbed
from torchvision.datasets import ImageFolder


class MaskingGenerator:
    """Block-wise masking as in BEiT."""

    def __init__(self, input_size=14, num_masking_patches=75, min_num_patches=16, max_num_patches=None,
                 min_aspect=0.3):
        self.height = self.width = input_size
        self.num_masking_patches = num_masking_patches
        self.min_num_patches = min_num_patches
        self.max_num_patches = num_masking_patches if max_num_patches is None else max_num_patches
        self.log_aspect_ratio = (math.log(min_aspect), math.log(1 / min_aspect))

    def _mask(self, mask, max_mask_patches):
        delta = 0
        for _ in range(10):
            target_area = random.uniform(self.min_num_patches, max_mask_patches)
            aspect_ratio = math.exp(random.uniform(*self.log_aspect_ratio))
            h = int(round(math.sqrt(target_area * aspect_ratio)))
            w = int(round(math.sqrt(target_area / aspect_ratio)))
            if w < self.width and h < self.height:
                top = random.randint(0, self.height - h)
                left = random.randint(0, self.width - w)
                num_masked = mask[top: top + h, left: left + w].sum()
                if 0 < h * w - num_masked <= max_mask_patches:
                    for i in range(top, top + h):
                        for j in range(left, left + w):
                            if mask[i, j] == 0:
                                mask[i, j] = 1
                                delta += 1
                if delta > 0:
                    break
        return delta

    def __call__(self):
        mask = np.zeros((self.height, self.width), dtype=bool)
        mask_count = 0
        while mask_count < self.num_masking_patches:
            max_mask_patches = min(self.num_masking_patches - mask_count, self.max_num_patches)
            delta = self._mask(mask, max_mask_patches)
            if delta == 0:
                break
            mask_count += delta
        return mask


class BEiTTransform:
    def __init__(self, args):
        self.common = T.Compose([T.ColorJitter(0.4, 0.4, 0.4), T.RandomHorizontalFlip(p=0.5),
                                 T.RandomResizedCrop(224, scale=(0.08, 1.0))])
        self.patch_transform = T.Compose([T.ToTensor(), T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
        self.visual_token_transform = T.Compose([T.Resize(112, interpolation=T.InterpolationMode.LANCZOS),
                                                 T.ToTensor(), map_pixels])
        self.masked_position_generator = MaskingGenerator(14, num_masking_patches=args.num_mask_patches)

    def __call__(self, image):
        image = self.common(image)
        return (self.patch_transform(image), self.visual_token_transform(image),
                self.masked_position_generator())


class BEiT(nn.Module):
    def __init__(self, vocab_size=8192, embed_dim=768, depth=12, num_heads=12, drop_path_rate=0.1,
                 layer_scale_init_value=0.1):
        super().__init__()
        self.patch_embed = PatchEmbed(224, 16, 3, embed_dim)
        num_patches = self.patch_embed.num_patches
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.mask_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, embed_dim))
        dpr = [x.item() for x in torch.linspace(0, drop_path_rate, depth)]
        self.blocks = nn.ModuleList([Block(embed_dim, num_heads, 4.0, qkv_bias=True, drop_path=dpr[i],
                                           init_values=layer_scale_init_value) for i in range(depth)])
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.lm_head = nn.Linear(embed_dim, vocab_size)
        for p in (self.cls_token, self.mask_token, self.pos_embed):
            nn.init.trunc_normal_(p, std=0.02)
        nn.init.trunc_normal_(self.lm_head.weight, std=0.02)

    def forward(self, x, bool_masked_pos):
        x = self.patch_embed(x)
        B, L, _ = x.shape
        w = bool_masked_pos.unsqueeze(-1).type_as(x)
        x = x * (1 - w) + self.mask_token.expand(B, L, -1) * w
        x = torch.cat((self.cls_token.expand(B, -1, -1), x), dim=1) + self.pos_embed
        for blk in self.blocks:
            x = blk(x)
        x = self.norm(x)[:, 1:]
        return self.lm_head(x[bool_masked_pos])


def get_args():
    parser = argparse.ArgumentParser("BEiT pre-training")
    parser.add_argument("--batch_size", default=64, type=int)
    parser.add_argument("--epochs", default=300, type=int)
    parser.add_argument("--save_ckpt_freq", default=20, type=int)
    parser.add_argument("--discrete_vae_weight_path", default="/models/dall_e", type=str)
    parser.add_argument("--num_mask_patches", default=75, type=int)
    parser.add_argument("--lr", default=1.5e-3, type=float)
    parser.add_argument("--min_lr", default=1e-5, type=float)
    parser.add_argument("--warmup_epochs", default=10, type=int)
    parser.add_argument("--weight_decay", default=0.05, type=float)
    parser.add_argument("--clip_grad", default=3.0, type=float)
    parser.add_argument("--data_path", default="/data/imagenet/train", type=str)
    parser.add_argument("--output_dir", default="./beit_base_pt", type=str)
    parser.add_argument("--auto_resume", action="store_true", default=True)
    parser.add_argument("--num_workers", default=10, type=int)
    parser.add_argument("--seed", default=0, type=int)
    return parser.parse_args()


def cosine_lr(base, final, total_iters, warmup_iters, it):
    if it < warmup_iters:
        return base * it / warmup_iters
    return final + 0.5 * (base - final) * (1 + math.cos(math.pi * (it - warmup_iters) / (total_iters - warmup_iters)))


def main(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    seed = args.seed + rank
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)

    dataset = ImageFolder(args.data_path, transform=BEiTTransform(args))
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True)
    loader = torch.utils.data.DataLoader(dataset, sampler=sampler, batch_size=args.batch_size,
                                         num_workers=args.num_workers, pin_memory=True, drop_last=True)

    d_vae = load_model(os.path.join(args.discrete_vae_weight_path, "encoder.pkl"), device)
    d_vae.eval()
    for p in d_vae.parameters():
        p.requires_grad = False

    model = BEiT().to(device)
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    model_without_ddp = model.module

    total_batch = args.batch_size * world_size
    args.lr = args.lr * total_batch / 2048
    args.min_lr = args.min_lr * total_batch / 2048
    decay, no_decay = [], []
    for n, p in model_without_ddp.named_parameters():
        (no_decay if p.ndim == 1 or n in ("cls_token", "mask_token", "pos_embed") else decay).append(p)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.999))
    scaler = torch.cuda.amp.GradScaler()

    start_epoch = 0
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
    if args.auto_resume:
        ckpts = sorted(glob.glob(os.path.join(args.output_dir, "checkpoint-*.pth")),
                       key=lambda p: int(p.split("-")[-1].split(".")[0]))
        if ckpts:
            checkpoint = torch.load(ckpts[-1])
            model_without_ddp.load_state_dict(checkpoint["model"])
            optimizer.load_state_dict(checkpoint["optimizer"])
            scaler.load_state_dict(checkpoint["scaler"])
            start_epoch = checkpoint["epoch"] + 1
            if rank == 0:
                print(f"Resume checkpoint {ckpts[-1]} (epoch {start_epoch})")

    niter = len(loader)
    total_iters, warmup_iters = args.epochs * niter, args.warmup_epochs * niter
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        stats = torch.zeros(3, device=device)
        for step, (samples, images, bool_masked_pos) in enumerate(loader):
            it = epoch * niter + step
            lr = cosine_lr(args.lr, args.min_lr, total_iters, warmup_iters, it)
            for g in optimizer.param_groups:
                g["lr"] = lr
            samples = samples.to(device, non_blocking=True)
            images = images.to(device, non_blocking=True)
            bool_masked_pos = bool_masked_pos.to(device, non_blocking=True).flatten(1).to(torch.bool)

            with torch.no_grad():
                input_ids = torch.argmax(d_vae(images), dim=1).flatten(1)
                labels = input_ids[bool_masked_pos]

            with torch.cuda.amp.autocast():
                outputs = model(samples, bool_masked_pos)
                loss = F.cross_entropy(outputs, labels)
            loss_value = loss.item()
            if not math.isfinite(loss_value):
                print(f"Loss is {loss_value}, stopping training")
                raise SystemExit(1)

            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
            scaler.step(optimizer)
            scaler.update()

            mlm_acc = (outputs.max(-1)[1] == labels).float().mean()
            stats += torch.stack([loss.detach().float(), mlm_acc, torch.ones((), device=device)])
            if rank == 0 and step % 100 == 0:
                print(f"Epoch {epoch} [{step}/{niter}] loss {loss_value:.4f} mlm_acc {mlm_acc.item():.4f} lr {lr:.2e}")

        dist.all_reduce(stats)
        if rank == 0:
            log = {"epoch": epoch, "loss": (stats[0] / stats[2]).item(), "mlm_acc": (stats[1] / stats[2]).item(),
                   "epoch_time": time.time() - t0}
            print(json.dumps(log))
            with open(os.path.join(args.output_dir, "log.txt"), "a") as f:
                f.write(json.dumps(log) + "\n")
            if (epoch + 1) % args.save_ckpt_freq == 0 or epoch + 1 == args.epochs:
                torch.save({"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                            "scaler": scaler.state_dict(), "epoch": epoch, "args": vars(args)},
                           os.path.join(args.output_dir, f"checkpoint-{epoch}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main(get_args())
