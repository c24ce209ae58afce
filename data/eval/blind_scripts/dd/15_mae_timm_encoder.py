"""MAE pre-training that reuses timm's ViT as the encoder (so the pre-trained weights load
directly into timm for fine-tuning) and adds a small transformer decoder on top."""
import argparse
import json
import math
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision.transforms as T
from timm.models.vision_transformer import Block
from torch.nn.parallel import DistributedDataParallel as DDP
from torchvision.datasets import ImageFolder


def parse_args():
    parser = argparse.ArgumentParser("MAE (timm encoder)")
    parser.add_argument("--model", default="vit_base_patch16_224")
    parser.add_argument("--data_path", default="/data/imagenet/train")
    parser.add_argument("--output_dir", default="./mae_timm_vitb")
    parser.add_argument("--batch_size", default=128, type=int, help="per GPU")
    parser.add_argument("--epochs", default=400, type=int)
    parser.add_argument("--warmup_epochs", default=40, type=int)
    parser.add_argument("--blr", default=1.5e-4, type=float)
    parser.add_argument("--weight_decay", default=0.05, type=float)
    parser.add_argument("--mask_ratio", default=0.75, type=float)
    parser.add_argument("--decoder_dim", default=512, type=int)
    parser.add_argument("--decoder_depth", default=8, type=int)
    parser.add_argument("--num_workers", default=10, type=int)
    parser.add_argument("--save_every", default=20, type=int)
    return parser.parse_args()


class MAE(nn.Module):
    def __init__(self, encoder, decoder_dim=512, decoder_depth=8, decoder_heads=16):
        super().__init__()
        self.encoder = encoder
        dim = encoder.embed_dim
        self.patch_size = encoder.patch_embed.patch_size[0]
        num_patches = encoder.patch_embed.num_patches
        self.decoder_embed = nn.Linear(dim, decoder_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, decoder_dim))
        self.decoder_pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, decoder_dim))
        self.decoder_blocks = nn.Sequential(*[Block(decoder_dim, decoder_heads, 4.0, qkv_bias=True)
                                              for _ in range(decoder_depth)])
        self.decoder_norm = nn.LayerNorm(decoder_dim)
        self.decoder_pred = nn.Linear(decoder_dim, self.patch_size ** 2 * 3)
        nn.init.normal_(self.mask_token, std=0.02)
        nn.init.trunc_normal_(self.decoder_pos_embed, std=0.02)

    def encode(self, imgs, mask_ratio):
        enc = self.encoder
        x = enc.patch_embed(imgs)
        x = x + enc.pos_embed[:, 1:, :]
        B, L, D = x.shape
        len_keep = int(L * (1 - mask_ratio))
        noise = torch.rand(B, L, device=x.device)
        ids_shuffle = noise.argsort(dim=1)
        ids_restore = ids_shuffle.argsort(dim=1)
        x = torch.gather(x, 1, ids_shuffle[:, :len_keep].unsqueeze(-1).expand(-1, -1, D))
        mask = torch.ones(B, L, device=x.device)
        mask[:, :len_keep] = 0
        mask = torch.gather(mask, 1, ids_restore)
        cls = (enc.cls_token + enc.pos_embed[:, :1, :]).expand(B, -1, -1)
        x = torch.cat([cls, x], dim=1)
        x = enc.blocks(x)
        x = enc.norm(x)
        return x, mask, ids_restore

    def decode(self, x, ids_restore):
        x = self.decoder_embed(x)
        B, L = ids_restore.shape
        tokens = torch.cat([x[:, 1:], self.mask_token.expand(B, L + 1 - x.shape[1], -1)], dim=1)
        tokens = torch.gather(tokens, 1, ids_restore.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        x = torch.cat([x[:, :1], tokens], dim=1) + self.decoder_pos_embed
        x = self.decoder_blocks(x)
        return self.decoder_pred(self.decoder_norm(x))[:, 1:]

    def forward(self, imgs, mask_ratio=0.75):
        latent, mask, ids_restore = self.encode(imgs, mask_ratio)
        pred = self.decode(latent, ids_restore)
        p = self.patch_size
        B, _, H, W = imgs.shape
        target = imgs.reshape(B, 3, H // p, p, W // p, p).permute(0, 2, 4, 3, 5, 1).reshape(B, -1, p * p * 3)
        mean, var = target.mean(-1, keepdim=True), target.var(-1, keepdim=True)
        target = (target - mean) / (var + 1e-6).sqrt()
        loss = ((pred - target) ** 2).mean(-1)
        return (loss * mask).sum() / mask.sum()


def lr_at(epoch_f, base_lr, args):
    if epoch_f < args.warmup_epochs:
        return base_lr * epoch_f / args.warmup_epochs
    return base_lr * 0.5 * (1 + math.cos(math.pi * (epoch_f - args.warmup_epochs) / (args.epochs - args.warmup_epochs)))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42 + rank)

    transform = T.Compose([T.RandomResizedCrop(224, scale=(0.2, 1.0), interpolation=T.InterpolationMode.BICUBIC),
                           T.RandomHorizontalFlip(), T.ToTensor(),
                           T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    dataset = ImageFolder(args.data_path, transform=transform)
    sampler = torch.utils.data.DistributedSampler(dataset, shuffle=True)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler,
                                         num_workers=args.num_workers, pin_memory=True, drop_last=True)

    encoder = timm.create_model(args.model, pretrained=False, drop_path_rate=0.0)
    model = MAE(encoder, args.decoder_dim, args.decoder_depth).to(device)
    model = DDP(model, device_ids=[local_rank])

    base_lr = args.blr * args.batch_size * world_size / 256
    decay, no_decay = [], []
    for n, p in model.module.named_parameters():
        (no_decay if p.ndim < 2 or "token" in n or "pos_embed" in n else decay).append(p)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=base_lr, betas=(0.9, 0.95))
    scaler = torch.cuda.amp.GradScaler()

    start_epoch = 0
    ckpt_file = os.path.join(args.output_dir, "checkpoint-last.pth")
    if os.path.isfile(ckpt_file):
        ckpt = torch.load(ckpt_file, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"] + 1
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"effective batch {args.batch_size * world_size}, lr {base_lr:.2e}")

    n_iter = len(loader)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        stats = torch.zeros(2, device=device)
        for i, (imgs, _) in enumerate(loader):
            lr = lr_at(epoch + i / n_iter, base_lr, args)
            for g in optimizer.param_groups:
                g["lr"] = lr
            imgs = imgs.to(device, non_blocking=True)
            with torch.cuda.amp.autocast():
                loss = model(imgs, args.mask_ratio)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            stats += torch.stack([loss.detach().float(), torch.ones((), device=device)])
            if rank == 0 and i % 100 == 0:
                print(f"epoch {epoch} [{i}/{n_iter}] loss {loss.item():.4f} lr {lr:.2e}", flush=True)

        dist.all_reduce(stats)
        if rank == 0:
            log = {"epoch": epoch, "loss": (stats[0] / stats[1]).item(), "time_s": round(time.time() - t0)}
            print(json.dumps(log), flush=True)
            with open(os.path.join(args.output_dir, "log.txt"), "a") as f:
                f.write(json.dumps(log) + "\n")
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scaler": scaler.state_dict(), "epoch": epoch}
            torch.save(state, ckpt_file)
            if (epoch + 1) % args.save_every == 0:
                torch.save({"encoder": model.module.encoder.state_dict(), "epoch": epoch},
                           os.path.join(args.output_dir, f"encoder-ep{epoch + 1}.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
