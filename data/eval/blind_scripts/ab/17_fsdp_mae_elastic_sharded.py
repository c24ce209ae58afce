"""MAE pre-training (ViT-H/14 encoder, light decoder) with FSDP on an elastic,
preemptible node pool.

    torchrun --nnodes=2:8 --nproc_per_node=8 --max-restarts=50 \
        --rdzv-backend=c10d --rdzv-endpoint=$RDZV_HOST:29400 --rdzv-id=mae-vith \
        17_fsdp_mae_elastic_sharded.py --data /mnt/weka/laion_subset --ckpt /mnt/weka/ckpt/mae_vith

Checkpoints are written shard-per-rank so a save takes seconds instead of
gathering the full 630M-param model + optimizer on rank 0.
"""
import argparse
import functools
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from timm.models.vision_transformer import Block, PatchEmbed
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


class MAE(nn.Module):
    def __init__(self, img=224, patch=14, dim=1280, depth=32, heads=16,
                 dec_dim=512, dec_depth=8, dec_heads=16, mask_ratio=0.75):
        super().__init__()
        self.patch_embed = PatchEmbed(img, patch, 3, dim)
        n = self.patch_embed.num_patches
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.register_buffer("pos", torch.zeros(1, n + 1, dim))
        self.blocks = nn.ModuleList([Block(dim, heads, 4.0, qkv_bias=True) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.dec_embed = nn.Linear(dim, dec_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dec_dim))
        self.register_buffer("dec_pos", torch.zeros(1, n + 1, dec_dim))
        self.dec_blocks = nn.ModuleList([Block(dec_dim, dec_heads, 4.0, qkv_bias=True)
                                         for _ in range(dec_depth)])
        self.dec_norm = nn.LayerNorm(dec_dim)
        self.dec_pred = nn.Linear(dec_dim, patch * patch * 3)
        self.patch, self.mask_ratio = patch, mask_ratio
        nn.init.normal_(self.cls, std=0.02)
        nn.init.normal_(self.mask_token, std=0.02)
        nn.init.trunc_normal_(self.pos, std=0.02)
        nn.init.trunc_normal_(self.dec_pos, std=0.02)

    def patchify(self, imgs):
        p = self.patch
        b, c, h, w = imgs.shape
        x = imgs.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1)
        return x.reshape(b, (h // p) * (w // p), p * p * c)

    def forward(self, imgs):
        x = self.patch_embed(imgs) + self.pos[:, 1:]
        b, n, d = x.shape
        keep = int(n * (1 - self.mask_ratio))
        noise = torch.rand(b, n, device=x.device)
        ids_shuffle = noise.argsort(1)
        ids_restore = ids_shuffle.argsort(1)
        ids_keep = ids_shuffle[:, :keep]
        x = torch.gather(x, 1, ids_keep.unsqueeze(-1).expand(-1, -1, d))
        mask = torch.ones(b, n, device=x.device)
        mask[:, :keep] = 0
        mask = torch.gather(mask, 1, ids_restore)

        cls = (self.cls + self.pos[:, :1]).expand(b, -1, -1)
        x = torch.cat([cls, x], 1)
        for blk in self.blocks:
            x = blk(x)
        x = self.dec_embed(self.norm(x))
        mt = self.mask_token.expand(b, n + 1 - x.size(1), -1)
        y = torch.cat([x[:, 1:], mt], 1)
        y = torch.gather(y, 1, ids_restore.unsqueeze(-1).expand(-1, -1, y.size(-1)))
        y = torch.cat([x[:, :1], y], 1) + self.dec_pos
        for blk in self.dec_blocks:
            y = blk(y)
        pred = self.dec_pred(self.dec_norm(y))[:, 1:]

        target = self.patchify(imgs)
        mean, var = target.mean(-1, keepdim=True), target.var(-1, keepdim=True)
        target = (target - mean) / (var + 1e-6).sqrt()
        loss = ((pred.float() - target) ** 2).mean(-1)
        return (loss * mask).sum() / mask.sum(), pred, mask


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--blr", type=float, default=1.5e-4)
    ap.add_argument("--epochs", type=int, default=400)
    ap.add_argument("--warmup-epochs", type=int, default=40)
    ap.add_argument("--save-every-steps", type=int, default=500)
    return ap.parse_args()


def shard_path(root, rank):
    return os.path.join(root, f"shard_rank{rank:04d}.pt")


def save_sharded(model, optimizer, meta, root, rank):
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        state = {"model": model.state_dict(), "optim": optimizer.state_dict(), **meta}
    tmp = shard_path(root, rank) + ".tmp"
    torch.save(state, tmp)
    dist.barrier()
    os.replace(tmp, shard_path(root, rank))
    dist.barrier()


def load_sharded(model, optimizer, root, rank):
    path = shard_path(root, rank)
    if not os.path.exists(path):
        return None
    state = torch.load(path, map_location="cpu")
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optim"])
    return state


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    os.makedirs(args.ckpt, exist_ok=True)

    tf = transforms.Compose([transforms.RandomResizedCrop(224, scale=(0.2, 1.0), interpolation=3),
                             transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                             transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    ds = datasets.ImageFolder(args.data, tf)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=10,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    torch.manual_seed(0)
    model = MAE()
    wrap = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    model = FSDP(model, auto_wrap_policy=wrap, device_id=device,
                 sharding_strategy=ShardingStrategy.FULL_SHARD,
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                buffer_dtype=torch.bfloat16))
    eff_bs = args.bs * world
    lr = args.blr * eff_bs / 256
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.05)
    steps_per_epoch = len(loader)

    def lr_at(it):
        e = it / steps_per_epoch
        if e < args.warmup_epochs:
            return lr * e / args.warmup_epochs
        return lr * 0.5 * (1 + math.cos(math.pi * (e - args.warmup_epochs) / (args.epochs - args.warmup_epochs)))

    start_epoch, start_step = 0, 0
    state = load_sharded(model, optimizer, args.ckpt, rank)
    if state is not None:
        start_epoch, start_step = state["epoch"], state["step"]
        if rank == 0:
            print(f"resumed epoch {start_epoch} step {start_step} (world {world})", flush=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        first = start_step if epoch == start_epoch else 0
        for i, (imgs, _) in enumerate(loader):
            if i < first:
                continue
            it = epoch * steps_per_epoch + i
            for g in optimizer.param_groups:
                g["lr"] = lr_at(it)
            imgs = imgs.to(device, non_blocking=True)
            loss, _, _ = model(imgs)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

            if i % 50 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} it {i}/{steps_per_epoch} loss {l.item():.4f} "
                          f"lr {lr_at(it):.2e} {(time.time() - t0) / (i - first + 1):.2f}s/it", flush=True)
            if (i + 1) % args.save_every_steps == 0:
                save_sharded(model, optimizer, {"epoch": epoch, "step": i + 1}, args.ckpt, rank)
        save_sharded(model, optimizer, {"epoch": epoch + 1, "step": 0}, args.ckpt, rank)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
