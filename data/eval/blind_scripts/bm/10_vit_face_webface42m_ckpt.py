"""ViT-B face recognition on WebFace42M with Partial FC and activation checkpointing.

Uses insightface's arcface_torch modules (losses.py, partial_fc_v2.py, dataset.py)
from the repository root.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29500 \
        10_vit_face_webface42m_ckpt.py --rec /shared/webface42m --output /shared/work_dirs/vit_b_wf42m
"""
import argparse
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils.checkpoint as cp
from torch.nn.parallel import DistributedDataParallel

from dataset import get_dataloader
from losses import CombinedMarginLoss
from lr_scheduler import PolyScheduler
from partial_fc_v2 import PartialFC_V2


class Mlp(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), nn.ReLU6(), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=False)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, L, D = x.shape
        q, k, v = self.qkv(x).reshape(B, L, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        with torch.cuda.amp.autocast(True):
            attn = (q.float() @ k.float().transpose(-2, -1)) * self.scale
            attn = attn.softmax(dim=-1)
            x = (attn @ v.float()).transpose(1, 2).reshape(B, L, D)
        return self.proj(x)


class Block(nn.Module):
    def __init__(self, dim, heads, mlp_ratio=4.0, patch_n=144):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        self.extra_gflops = (patch_n * patch_n * dim * 2) / 1e9

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class FaceViT(nn.Module):
    def __init__(self, img_size=112, patch=9, dim=512, depth=24, heads=8, num_features=512,
                 mask_ratio=0.1, using_checkpoint=True):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, kernel_size=patch, stride=patch)
        n = (img_size // patch) ** 2
        self.pos_embed = nn.Parameter(torch.zeros(1, n, dim))
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.mask_ratio = mask_ratio
        self.blocks = nn.ModuleList([Block(dim, heads, patch_n=n) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.feature = nn.Sequential(nn.Linear(dim * n, dim, bias=False), nn.BatchNorm1d(dim),
                                     nn.Linear(dim, num_features, bias=False), nn.BatchNorm1d(num_features))
        self.using_checkpoint = using_checkpoint
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.mask_token, std=0.02)

    def random_masking(self, x):
        B, L, D = x.shape
        keep = int(L * (1 - self.mask_ratio))
        ids = torch.rand(B, L, device=x.device).argsort(dim=1)
        mask = torch.ones(B, L, 1, device=x.device)
        mask.scatter_(1, ids[:, :keep, None], 0.0)
        return x * (1 - mask) + self.mask_token * mask

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2) + self.pos_embed
        if self.training and self.mask_ratio > 0:
            x = self.random_masking(x)
        for blk in self.blocks:
            if self.using_checkpoint and self.training:
                x = cp.checkpoint(blk, x)
            else:
                x = blk(x)
        x = self.norm(x.float())
        return self.feature(x.reshape(x.size(0), -1))


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rec", default="/shared/webface42m")
    ap.add_argument("--num-classes", type=int, default=2059906)
    ap.add_argument("--num-images", type=int, default=42474557)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW lr for a global batch of 4096")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--sample-rate", type=float, default=0.3)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--warmup-epochs", type=int, default=4)
    ap.add_argument("--mask-ratio", type=float, default=0.1)
    ap.add_argument("--output", default="/shared/work_dirs/vit_b_wf42m")
    ap.add_argument("--seed", type=int, default=2048)
    return ap.parse_args()


def main():
    args = parse()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(message)s")
    if rank == 0:
        os.makedirs(args.output, exist_ok=True)

    loader = get_dataloader(args.rec, local_rank, args.batch_size, dali=False, seed=args.seed, num_workers=4)

    backbone = FaceViT(mask_ratio=args.mask_ratio).cuda()
    # the mask token is only touched when masking is on, so some steps leave parameters unused
    backbone = DistributedDataParallel(backbone, device_ids=[local_rank], bucket_cap_mb=16,
                                       find_unused_parameters=True)
    backbone.train()

    margin_loss = CombinedMarginLoss(64, 1.0, 0.0, 0.4, 0)
    module_fc = PartialFC_V2(margin_loss, 512, args.num_classes, args.sample_rate, fp16=True)
    module_fc.train().cuda()

    total_batch = args.batch_size * world_size
    lr = args.lr * total_batch / 4096
    optimizer = torch.optim.AdamW([{"params": backbone.parameters()}, {"params": module_fc.parameters()}],
                                  lr=lr, weight_decay=args.weight_decay)
    steps_per_epoch = args.num_images // total_batch
    scheduler = PolyScheduler(optimizer, base_lr=lr, max_steps=steps_per_epoch * args.epochs,
                              warmup_steps=steps_per_epoch * args.warmup_epochs)
    amp = torch.cuda.amp.GradScaler(growth_interval=100)

    start_epoch, global_step = 0, 0
    resume_path = os.path.join(args.output, f"checkpoint_gpu_{rank}.pt")
    if os.path.exists(resume_path):
        ckpt = torch.load(resume_path, map_location="cpu")
        start_epoch, global_step = ckpt["epoch"], ckpt["global_step"]
        backbone.module.load_state_dict(ckpt["state_dict_backbone"])
        module_fc.load_state_dict(ckpt["state_dict_softmax_fc"])
        optimizer.load_state_dict(ckpt["state_optimizer"])
        scheduler.load_state_dict(ckpt["state_lr_scheduler"])
        del ckpt

    for epoch in range(start_epoch, args.epochs):
        if isinstance(loader, torch.utils.data.DataLoader):
            loader.sampler.set_epoch(epoch)
        tic = time.time()
        for _, (img, local_labels) in enumerate(loader):
            global_step += 1
            with torch.cuda.amp.autocast():
                local_embeddings = backbone(img)
            loss = module_fc(local_embeddings.float(), local_labels)
            amp.scale(loss).backward()
            amp.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(backbone.parameters(), 5)
            amp.step(optimizer)
            amp.update()
            optimizer.zero_grad()
            scheduler.step()
            if global_step % 50 == 0 and rank == 0:
                speed = 50 * total_batch / (time.time() - tic)
                tic = time.time()
                logging.info("epoch %d step %d loss %.4f lr %.6f %.0f img/s", epoch, global_step,
                             loss.item(), scheduler.get_last_lr()[0], speed)

        torch.save({"epoch": epoch + 1, "global_step": global_step,
                    "state_dict_backbone": backbone.module.state_dict(),
                    "state_dict_softmax_fc": module_fc.state_dict(),
                    "state_optimizer": optimizer.state_dict(),
                    "state_lr_scheduler": scheduler.state_dict()}, resume_path)
        if rank == 0:
            torch.save(backbone.module.state_dict(), os.path.join(args.output, "model.pt"))

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
