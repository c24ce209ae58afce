# Masked autoencoder pre-training (ViT-B/16) -- condensed from our internal fork of MAE.
#
#   OMP_NUM_THREADS=1 torchrun --nproc_per_node=8 main_pretrain.py \
#       --batch_size 64 --accum_iter 4 --model mae_vit_base_patch16 --mask_ratio 0.75 \
#       --epochs 800 --warmup_epochs 40 --blr 1.5e-4 --data_path ${IMAGENET_DIR}
import argparse
import datetime
import json
import math
import os
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision.datasets as datasets
import torchvision.transforms as transforms
from timm.models.vision_transformer import Block, PatchEmbed
from torch.utils.tensorboard import SummaryWriter


def get_args_parser():
    parser = argparse.ArgumentParser("MAE pre-training", add_help=False)
    parser.add_argument("--batch_size", default=64, type=int, help="per GPU")
    parser.add_argument("--epochs", default=400, type=int)
    parser.add_argument("--accum_iter", default=1, type=int)
    parser.add_argument("--model", default="mae_vit_base_patch16", type=str)
    parser.add_argument("--input_size", default=224, type=int)
    parser.add_argument("--mask_ratio", default=0.75, type=float)
    parser.add_argument("--norm_pix_loss", action="store_true")
    parser.add_argument("--weight_decay", type=float, default=0.05)
    parser.add_argument("--blr", type=float, default=1e-3, help="base lr: absolute_lr = base_lr * total_batch_size / 256")
    parser.add_argument("--min_lr", type=float, default=0.0)
    parser.add_argument("--warmup_epochs", type=int, default=40)
    parser.add_argument("--data_path", default="/datasets01/imagenet_full_size/061417/", type=str)
    parser.add_argument("--output_dir", default="./output_dir")
    parser.add_argument("--log_dir", default="./output_dir")
    parser.add_argument("--seed", default=0, type=int)
    parser.add_argument("--resume", default="")
    parser.add_argument("--start_epoch", default=0, type=int)
    parser.add_argument("--num_workers", default=10, type=int)
    return parser


class MaskedAutoencoderViT(nn.Module):
    def __init__(self, img_size=224, patch_size=16, in_chans=3, embed_dim=768, depth=12, num_heads=12,
                 decoder_embed_dim=512, decoder_depth=8, decoder_num_heads=16, mlp_ratio=4.0,
                 norm_layer=partial(nn.LayerNorm, eps=1e-6), norm_pix_loss=False):
        super().__init__()
        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim)
        num_patches = self.patch_embed.num_patches
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, embed_dim), requires_grad=False)
        self.blocks = nn.ModuleList([Block(embed_dim, num_heads, mlp_ratio, qkv_bias=True, norm_layer=norm_layer)
                                     for _ in range(depth)])
        self.norm = norm_layer(embed_dim)
        self.decoder_embed = nn.Linear(embed_dim, decoder_embed_dim, bias=True)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, decoder_embed_dim))
        self.decoder_pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, decoder_embed_dim), requires_grad=False)
        self.decoder_blocks = nn.ModuleList([Block(decoder_embed_dim, decoder_num_heads, mlp_ratio, qkv_bias=True,
                                                   norm_layer=norm_layer) for _ in range(decoder_depth)])
        self.decoder_norm = norm_layer(decoder_embed_dim)
        self.decoder_pred = nn.Linear(decoder_embed_dim, patch_size ** 2 * in_chans, bias=True)
        self.norm_pix_loss = norm_pix_loss
        nn.init.normal_(self.cls_token, std=0.02)
        nn.init.normal_(self.mask_token, std=0.02)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.decoder_pos_embed, std=0.02)

    def patchify(self, imgs):
        p = self.patch_embed.patch_size[0]
        h = w = imgs.shape[2] // p
        x = imgs.reshape(imgs.shape[0], 3, h, p, w, p)
        x = torch.einsum("nchpwq->nhwpqc", x)
        return x.reshape(imgs.shape[0], h * w, p ** 2 * 3)

    def random_masking(self, x, mask_ratio):
        N, L, D = x.shape
        len_keep = int(L * (1 - mask_ratio))
        noise = torch.rand(N, L, device=x.device)
        ids_shuffle = torch.argsort(noise, dim=1)
        ids_restore = torch.argsort(ids_shuffle, dim=1)
        ids_keep = ids_shuffle[:, :len_keep]
        x_masked = torch.gather(x, dim=1, index=ids_keep.unsqueeze(-1).repeat(1, 1, D))
        mask = torch.ones([N, L], device=x.device)
        mask[:, :len_keep] = 0
        mask = torch.gather(mask, dim=1, index=ids_restore)
        return x_masked, mask, ids_restore

    def forward(self, imgs, mask_ratio=0.75):
        x = self.patch_embed(imgs) + self.pos_embed[:, 1:, :]
        x, mask, ids_restore = self.random_masking(x, mask_ratio)
        cls_tokens = (self.cls_token + self.pos_embed[:, :1, :]).expand(x.shape[0], -1, -1)
        x = torch.cat((cls_tokens, x), dim=1)
        for blk in self.blocks:
            x = blk(x)
        x = self.decoder_embed(self.norm(x))
        mask_tokens = self.mask_token.repeat(x.shape[0], ids_restore.shape[1] + 1 - x.shape[1], 1)
        x_ = torch.cat([x[:, 1:, :], mask_tokens], dim=1)
        x_ = torch.gather(x_, dim=1, index=ids_restore.unsqueeze(-1).repeat(1, 1, x.shape[2]))
        x = torch.cat([x[:, :1, :], x_], dim=1) + self.decoder_pos_embed
        for blk in self.decoder_blocks:
            x = blk(x)
        pred = self.decoder_pred(self.decoder_norm(x))[:, 1:, :]

        target = self.patchify(imgs)
        if self.norm_pix_loss:
            mean = target.mean(dim=-1, keepdim=True)
            var = target.var(dim=-1, keepdim=True)
            target = (target - mean) / (var + 1.0e-6) ** 0.5
        loss = ((pred - target) ** 2).mean(dim=-1)
        loss = (loss * mask).sum() / mask.sum()
        return loss, pred, mask


def mae_vit_base_patch16(**kw):
    return MaskedAutoencoderViT(patch_size=16, embed_dim=768, depth=12, num_heads=12, **kw)


def mae_vit_large_patch16(**kw):
    return MaskedAutoencoderViT(patch_size=16, embed_dim=1024, depth=24, num_heads=16, **kw)


def adjust_learning_rate(optimizer, epoch, args):
    if epoch < args.warmup_epochs:
        lr = args.lr * epoch / args.warmup_epochs
    else:
        lr = args.min_lr + (args.lr - args.min_lr) * 0.5 * (
            1.0 + math.cos(math.pi * (epoch - args.warmup_epochs) / (args.epochs - args.warmup_epochs)))
    for pg in optimizer.param_groups:
        pg["lr"] = lr * pg.get("lr_scale", 1.0)
    return lr


def train_one_epoch(model, data_loader, optimizer, scaler, epoch, args, device, log_writer=None):
    model.train(True)
    optimizer.zero_grad()
    total, count = torch.zeros((), device=device), 0
    for step, (samples, _) in enumerate(data_loader):
        if step % args.accum_iter == 0:
            adjust_learning_rate(optimizer, step / len(data_loader) + epoch, args)
        samples = samples.to(device, non_blocking=True)
        with torch.cuda.amp.autocast():
            loss, _, _ = model(samples, mask_ratio=args.mask_ratio)
        scaler.scale(loss / args.accum_iter).backward()
        if (step + 1) % args.accum_iter == 0:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        total += loss.detach()
        count += 1
        if log_writer is not None and (step + 1) % args.accum_iter == 0:
            epoch_1000x = int((step / len(data_loader) + epoch) * 1000)
            log_writer.add_scalar("train_loss_local", loss.item(), epoch_1000x)
            log_writer.add_scalar("lr", optimizer.param_groups[0]["lr"], epoch_1000x)
    dist.all_reduce(total)
    return {"loss": total.item() / (count * dist.get_world_size())}


def main(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    torch.manual_seed(args.seed + rank)
    np.random.seed(args.seed + rank)

    transform_train = transforms.Compose([
        transforms.RandomResizedCrop(args.input_size, scale=(0.2, 1.0), interpolation=3),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])])
    dataset_train = datasets.ImageFolder(os.path.join(args.data_path, "train"), transform=transform_train)

    log_writer = None
    if rank == 0:
        os.makedirs(args.log_dir, exist_ok=True)
        log_writer = SummaryWriter(log_dir=args.log_dir)

    data_loader_train = torch.utils.data.DataLoader(
        dataset_train, batch_size=args.batch_size, shuffle=True,
        num_workers=args.num_workers, pin_memory=True, drop_last=True)

    model = globals()[args.model](norm_pix_loss=args.norm_pix_loss).to(device)
    eff_batch_size = args.batch_size * args.accum_iter * world_size
    args.lr = args.blr * eff_batch_size / 256
    if rank == 0:
        print(f"base lr: {args.blr:.2e}  actual lr: {args.lr:.2e}  effective batch size: {eff_batch_size}")

    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    model_without_ddp = model.module
    decay, no_decay = [], []
    for n, p in model_without_ddp.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim == 1 or n in ("cls_token", "mask_token") else decay).append(p)
    optimizer = torch.optim.AdamW([{"params": no_decay, "weight_decay": 0.0},
                                   {"params": decay, "weight_decay": args.weight_decay}],
                                  lr=args.lr, betas=(0.9, 0.95))
    scaler = torch.cuda.amp.GradScaler()

    if args.resume:
        checkpoint = torch.load(args.resume, map_location="cpu")
        model_without_ddp.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scaler.load_state_dict(checkpoint["scaler"])
        args.start_epoch = checkpoint["epoch"] + 1

    start_time = time.time()
    for epoch in range(args.start_epoch, args.epochs):
        train_stats = train_one_epoch(model, data_loader_train, optimizer, scaler, epoch, args, device, log_writer)
        if rank == 0:
            if epoch % 20 == 0 or epoch + 1 == args.epochs:
                torch.save({"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                            "epoch": epoch, "scaler": scaler.state_dict(), "args": args},
                           os.path.join(args.output_dir, f"checkpoint-{epoch}.pth"))
            log_stats = {**{f"train_{k}": v for k, v in train_stats.items()}, "epoch": epoch}
            log_writer.add_scalar("train_loss", train_stats["loss"], epoch)
            log_writer.flush()
            with open(os.path.join(args.output_dir, "log.txt"), mode="a", encoding="utf-8") as f:
                f.write(json.dumps(log_stats) + "\n")

    if rank == 0:
        print("Training time {}".format(str(datetime.timedelta(seconds=int(time.time() - start_time)))))
    dist.destroy_process_group()


if __name__ == "__main__":
    args = get_args_parser().parse_args()
    if args.output_dir:
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    main(args)
