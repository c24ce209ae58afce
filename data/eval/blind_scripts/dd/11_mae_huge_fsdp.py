"""MAE pre-training of ViT-H/14 with FSDP (full sharding, bf16 mixed precision)."""
import argparse
import functools
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision.transforms as T
from timm.models.vision_transformer import Block, PatchEmbed
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torchvision.datasets import ImageFolder


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/fsx/datasets/imagenet/train")
    ap.add_argument("--out", default="/fsx/runs/mae_vith14")
    ap.add_argument("--bs", type=int, default=64, help="per GPU")
    ap.add_argument("--epochs", type=int, default=1600)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--blr", type=float, default=1.5e-4)
    ap.add_argument("--wd", type=float, default=0.05)
    ap.add_argument("--mask_ratio", type=float, default=0.75)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--save_every", type=int, default=10)
    ap.add_argument("--workers", type=int, default=12)
    return ap.parse_args()


def sincos_2d(grid, dim):
    ys, xs = torch.meshgrid(torch.arange(grid, dtype=torch.float32), torch.arange(grid, dtype=torch.float32),
                            indexing="ij")
    omega = 1.0 / (10000 ** (torch.arange(dim // 4, dtype=torch.float32) / (dim // 4)))
    ox, oy = xs.reshape(-1, 1) * omega, ys.reshape(-1, 1) * omega
    pe = torch.cat([oy.sin(), oy.cos(), ox.sin(), ox.cos()], dim=1)
    return torch.cat([torch.zeros(1, dim), pe]).unsqueeze(0)


class MAEViT(nn.Module):
    def __init__(self, img=224, patch=14, dim=1280, depth=32, heads=16, ddim=512, ddepth=8, dheads=16):
        super().__init__()
        self.patch = patch
        self.patch_embed = PatchEmbed(img, patch, 3, dim)
        grid = img // patch
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.register_buffer("pos_embed", sincos_2d(grid, dim))
        self.blocks = nn.ModuleList([Block(dim, heads, 4.0, qkv_bias=True) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.dec_embed = nn.Linear(dim, ddim)
        self.mask_token = nn.Parameter(torch.randn(1, 1, ddim) * 0.02)
        self.register_buffer("dec_pos_embed", sincos_2d(grid, ddim))
        self.dec_blocks = nn.ModuleList([Block(ddim, dheads, 4.0, qkv_bias=True) for _ in range(ddepth)])
        self.dec_norm = nn.LayerNorm(ddim)
        self.dec_pred = nn.Linear(ddim, patch * patch * 3)

    def forward(self, imgs, mask_ratio=0.75):
        x = self.patch_embed(imgs) + self.pos_embed[:, 1:]
        B, L, D = x.shape
        n_keep = int(L * (1 - mask_ratio))
        shuffle = torch.rand(B, L, device=x.device).argsort(1)
        restore = shuffle.argsort(1)
        x = x.gather(1, shuffle[:, :n_keep, None].expand(-1, -1, D))
        x = torch.cat([(self.cls_token + self.pos_embed[:, :1]).expand(B, -1, -1), x], 1)
        for blk in self.blocks:
            x = blk(x)
        x = self.dec_embed(self.norm(x))
        y = torch.cat([x[:, 1:], self.mask_token.expand(B, L - n_keep, -1)], 1)
        y = y.gather(1, restore[:, :, None].expand(-1, -1, y.shape[-1]))
        x = torch.cat([x[:, :1], y], 1) + self.dec_pos_embed
        for blk in self.dec_blocks:
            x = blk(x)
        pred = self.dec_pred(self.dec_norm(x))[:, 1:]

        p, h = self.patch, imgs.shape[-1] // self.patch
        tgt = imgs.reshape(B, 3, h, p, h, p).permute(0, 2, 4, 3, 5, 1).reshape(B, L, -1)
        tgt = (tgt - tgt.mean(-1, keepdim=True)) / (tgt.var(-1, keepdim=True) + 1e-6).sqrt()
        mask = torch.ones(B, L, device=x.device)
        mask[:, :n_keep] = 0
        mask = mask.gather(1, restore)
        return (((pred.float() - tgt) ** 2).mean(-1) * mask).sum() / mask.sum()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234 + rank)

    ds = ImageFolder(args.data, T.Compose([
        T.RandomResizedCrop(224, scale=(0.2, 1.0), interpolation=T.InterpolationMode.BICUBIC),
        T.RandomHorizontalFlip(), T.ToTensor(),
        T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])]))
    sampler = torch.utils.data.distributed.DistributedSampler(ds, shuffle=True)
    dl = torch.utils.data.DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=args.workers,
                                     pin_memory=True, drop_last=True)

    model = MAEViT()
    wrap_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    model = FSDP(model,
                 auto_wrap_policy=wrap_policy,
                 sharding_strategy=ShardingStrategy.FULL_SHARD,
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                buffer_dtype=torch.bfloat16),
                 device_id=torch.cuda.current_device(),
                 use_orig_params=True,
                 sync_module_states=True,
                 limit_all_gathers=True)

    lr = args.blr * args.bs * world / 256
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.}],
                            lr=lr, betas=(0.9, 0.95))

    start_epoch = 0
    resume = os.path.join(args.out, "latest.pt")
    if os.path.exists(resume):
        ckpt = torch.load(resume, map_location="cpu")
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
            model.load_state_dict(ckpt["model"])
        start_epoch = ckpt["epoch"] + 1
        del ckpt
        if rank == 0:
            print(f"resumed weights from {resume}, epoch {start_epoch} (optimizer state restarted)")

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{sum(p.numel() for p in model.parameters()) * world / 1e6:.0f}M params, lr {lr:.2e}")

    iters = len(dl)
    total, warm = args.epochs * iters, args.warmup * iters
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        run = torch.zeros(2, device="cuda")
        for i, (imgs, _) in enumerate(dl):
            step = epoch * iters + i
            cur = lr * step / warm if step < warm else lr * 0.5 * (1 + math.cos(math.pi * (step - warm) / (total - warm)))
            for g in opt.param_groups:
                g["lr"] = cur
            imgs = imgs.cuda(non_blocking=True)
            loss = model(imgs, args.mask_ratio)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(args.clip)
            opt.step()
            run += torch.stack([loss.detach(), torch.ones((), device="cuda")])
            if rank == 0 and i % 50 == 0:
                print(f"ep {epoch} it {i}/{iters} loss {loss.item():.4f} lr {cur:.2e}", flush=True)

        dist.all_reduce(run)
        if rank == 0:
            print(f"epoch {epoch} mean loss {(run[0] / run[1]).item():.4f} in {time.time() - t0:.0f}s", flush=True)

        if (epoch + 1) % args.save_every == 0 or epoch + 1 == args.epochs:
            if rank == 0:
                cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
                with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
                    state = model.state_dict()
                torch.save({"model": state, "epoch": epoch}, os.path.join(args.out, "latest.pt"))
                torch.save({"model": state, "epoch": epoch}, os.path.join(args.out, f"mae_vith14_ep{epoch + 1}.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
