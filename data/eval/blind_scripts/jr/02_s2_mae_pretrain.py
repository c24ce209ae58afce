# Masked autoencoder pretraining on Sentinel-2 L2A tiles (SSL4EO-S12 style, 12 bands, 224x224).
#
# torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
#     02_s2_mae_pretrain.py --data /shared/ssl4eo_s12/s2l2a --output /shared/ckpt/mae_s2_vitb
import argparse
import datetime
import json
import math
import os
import time
from functools import partial

import lmdb
import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from timm.models.vision_transformer import Block, PatchEmbed
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

# SSL4EO-S12 L2A band statistics (B1..B12 without B10), reflectance * 1e4
S2_MEAN = [1353.7, 1265.7, 1269.0, 1183.2, 1345.1, 1916.5, 2197.2, 2127.0, 2354.0, 732.4, 1820.1, 1118.2]
S2_STD = [897.3, 933.6, 1020.1, 1231.4, 1151.9, 1197.4, 1297.1, 1330.8, 1396.7, 487.9, 1081.5, 858.9]


def get_args():
    parser = argparse.ArgumentParser("MAE pretraining on Sentinel-2")
    parser.add_argument("--data", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--batch_size", type=int, default=64, help="per GPU")
    parser.add_argument("--accum_iter", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--warmup_epochs", type=int, default=10)
    parser.add_argument("--blr", type=float, default=1.5e-4, help="lr = blr * total_batch / 256")
    parser.add_argument("--min_lr", type=float, default=0.0)
    parser.add_argument("--weight_decay", type=float, default=0.05)
    parser.add_argument("--mask_ratio", type=float, default=0.75)
    parser.add_argument("--num_workers", type=int, default=10)
    parser.add_argument("--resume", default="")
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


class LMDBTiles(Dataset):
    def __init__(self, path, mean, std):
        self.path = path
        self.mean = np.asarray(mean, dtype=np.float32)[:, None, None]
        self.std = np.asarray(std, dtype=np.float32)[:, None, None]
        env = lmdb.open(path, readonly=True, lock=False, readahead=False, meminit=False)
        with env.begin() as txn:
            self.length = int(txn.get(b"__len__").decode())
        env.close()
        self.env = None

    def _open(self):
        # opened lazily so every dataloader worker gets its own handle
        self.env = lmdb.open(self.path, readonly=True, lock=False, readahead=False, meminit=False)

    def __len__(self):
        return self.length

    def __getitem__(self, idx):
        if self.env is None:
            self._open()
        with self.env.begin(buffers=True) as txn:
            buf = txn.get(f"{idx:08d}".encode())
        img = np.frombuffer(buf, dtype=np.uint16).reshape(12, 264, 264).astype(np.float32)
        y, x = np.random.randint(0, 264 - 224, size=2)
        img = img[:, y:y + 224, x:x + 224]
        if np.random.rand() < 0.5:
            img = img[:, :, ::-1]
        img = (img - self.mean) / self.std
        return torch.from_numpy(np.ascontiguousarray(img))


class MaskedAutoencoderViT(nn.Module):
    def __init__(self, img_size=224, patch_size=16, in_chans=12, embed_dim=768, depth=12, num_heads=12,
                 decoder_embed_dim=512, decoder_depth=8, decoder_num_heads=16, mlp_ratio=4.0):
        super().__init__()
        norm_layer = partial(nn.LayerNorm, eps=1e-6)
        self.in_chans = in_chans
        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim)
        num_patches = self.patch_embed.num_patches
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, embed_dim))
        self.blocks = nn.ModuleList([Block(embed_dim, num_heads, mlp_ratio, qkv_bias=True, norm_layer=norm_layer)
                                     for _ in range(depth)])
        self.norm = norm_layer(embed_dim)

        self.decoder_embed = nn.Linear(embed_dim, decoder_embed_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, decoder_embed_dim))
        self.decoder_pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, decoder_embed_dim))
        self.decoder_blocks = nn.ModuleList([Block(decoder_embed_dim, decoder_num_heads, mlp_ratio, qkv_bias=True,
                                                   norm_layer=norm_layer) for _ in range(decoder_depth)])
        self.decoder_norm = norm_layer(decoder_embed_dim)
        self.decoder_pred = nn.Linear(decoder_embed_dim, patch_size ** 2 * in_chans)
        self.initialize_weights()

    def initialize_weights(self):
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.decoder_pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=0.02)
        nn.init.normal_(self.mask_token, std=0.02)
        w = self.patch_embed.proj.weight.data
        nn.init.xavier_uniform_(w.view([w.shape[0], -1]))
        self.apply(self._init_weights)

    def _init_weights(self, m):
        if isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                nn.init.constant_(m.bias, 0)
        elif isinstance(m, nn.LayerNorm):
            nn.init.constant_(m.bias, 0)
            nn.init.constant_(m.weight, 1.0)

    def patchify(self, imgs):
        p = self.patch_embed.patch_size[0]
        h = w = imgs.shape[2] // p
        x = imgs.reshape(imgs.shape[0], self.in_chans, h, p, w, p)
        x = torch.einsum("nchpwq->nhwpqc", x)
        return x.reshape(imgs.shape[0], h * w, p ** 2 * self.in_chans)

    def random_masking(self, x, mask_ratio):
        N, L, D = x.shape
        len_keep = int(L * (1 - mask_ratio))
        noise = torch.rand(N, L, device=x.device)
        ids_shuffle = torch.argsort(noise, dim=1)
        ids_restore = torch.argsort(ids_shuffle, dim=1)
        ids_keep = ids_shuffle[:, :len_keep]
        x_masked = torch.gather(x, 1, ids_keep.unsqueeze(-1).repeat(1, 1, D))
        mask = torch.ones(N, L, device=x.device)
        mask[:, :len_keep] = 0
        mask = torch.gather(mask, 1, ids_restore)
        return x_masked, mask, ids_restore

    def forward(self, imgs, mask_ratio=0.75):
        x = self.patch_embed(imgs) + self.pos_embed[:, 1:, :]
        x, mask, ids_restore = self.random_masking(x, mask_ratio)
        cls = (self.cls_token + self.pos_embed[:, :1, :]).expand(x.shape[0], -1, -1)
        x = torch.cat((cls, x), dim=1)
        for blk in self.blocks:
            x = blk(x)
        x = self.norm(x)

        x = self.decoder_embed(x)
        mask_tokens = self.mask_token.repeat(x.shape[0], ids_restore.shape[1] + 1 - x.shape[1], 1)
        x_ = torch.cat([x[:, 1:, :], mask_tokens], dim=1)
        x_ = torch.gather(x_, 1, ids_restore.unsqueeze(-1).repeat(1, 1, x.shape[2]))
        x = torch.cat([x[:, :1, :], x_], dim=1) + self.decoder_pos_embed
        for blk in self.decoder_blocks:
            x = blk(x)
        pred = self.decoder_pred(self.decoder_norm(x))[:, 1:, :]

        target = self.patchify(imgs)
        mean = target.mean(dim=-1, keepdim=True)
        var = target.var(dim=-1, keepdim=True)
        target = (target - mean) / (var + 1e-6) ** 0.5
        loss = ((pred - target) ** 2).mean(dim=-1)
        loss = (loss * mask).sum() / mask.sum()
        return loss, pred, mask


def adjust_learning_rate(optimizer, epoch, args):
    if epoch < args.warmup_epochs:
        lr = args.lr * epoch / args.warmup_epochs
    else:
        lr = args.min_lr + (args.lr - args.min_lr) * 0.5 * (
            1.0 + math.cos(math.pi * (epoch - args.warmup_epochs) / (args.epochs - args.warmup_epochs)))
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
    return lr


def main(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", timeout=datetime.timedelta(minutes=30))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    # different augmentation / masking streams per rank; the sampler keeps the data split consistent
    torch.manual_seed(args.seed + rank)
    np.random.seed(args.seed + rank)

    eff_batch = args.batch_size * args.accum_iter * world_size
    args.lr = args.blr * eff_batch / 256
    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        print(f"effective batch {eff_batch}, lr {args.lr:.2e}")

    dataset = LMDBTiles(args.data, S2_MEAN, S2_STD)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, sampler=sampler, batch_size=args.batch_size, num_workers=args.num_workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = MaskedAutoencoderViT(in_chans=len(S2_MEAN)).to(device)
    model = DDP(model, device_ids=[local_rank])
    model_without_ddp = model.module

    param_groups = timm.optim.param_groups_weight_decay(model_without_ddp, args.weight_decay)
    optimizer = torch.optim.AdamW(param_groups, lr=args.lr, betas=(0.9, 0.95))
    scaler = torch.cuda.amp.GradScaler()

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model_without_ddp.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"] + 1
        if rank == 0:
            print(f"resumed from {args.resume} at epoch {start_epoch}")

    writer = SummaryWriter(os.path.join(args.output, "tb")) if rank == 0 else None
    steps_per_epoch = len(loader)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros(1, device=device)
        optimizer.zero_grad(set_to_none=True)
        for it, imgs in enumerate(loader):
            if it % args.accum_iter == 0:
                adjust_learning_rate(optimizer, it / steps_per_epoch + epoch, args)
            imgs = imgs.to(device, non_blocking=True)
            update = (it + 1) % args.accum_iter == 0
            with torch.autocast("cuda", dtype=torch.float16):
                if update:
                    loss, _, _ = model(imgs, mask_ratio=args.mask_ratio)
                else:
                    with model.no_sync():
                        loss, _, _ = model(imgs, mask_ratio=args.mask_ratio)
            if update:
                scaler.scale(loss / args.accum_iter).backward()
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 3.0)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
            else:
                with model.no_sync():
                    scaler.scale(loss / args.accum_iter).backward()
            loss_sum += loss.detach()

        dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
        epoch_loss = loss_sum.item() / (steps_per_epoch * world_size)
        if rank == 0:
            writer.add_scalar("train/loss", epoch_loss, epoch)
            writer.add_scalar("train/lr", optimizer.param_groups[0]["lr"], epoch)
            print(json.dumps({"epoch": epoch, "loss": round(epoch_loss, 5),
                              "time_s": round(time.time() - t0, 1)}), flush=True)
            if epoch % 10 == 0 or epoch + 1 == args.epochs:
                torch.save({"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                            "scaler": scaler.state_dict(), "epoch": epoch, "args": vars(args)},
                           os.path.join(args.output, f"checkpoint-{epoch}.pth"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(get_args())
