"""ViTPose-L (classic decoder) with activation checkpointing and gradient accumulation.

    torchrun --nproc_per_node=8 09_vitpose_large_gradckpt.py --pretrained mae_pretrain_vit_large.pth \
        --batch-per-gpu 32 --accum 2
"""
import argparse
import contextlib
import json
import os
import time
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from vitpose.backbone import Block, PatchEmbed
from vitpose.data import COCOTopDownDataset, get_final_preds, FLIP_PAIRS
from vitpose.evaluation import coco_oks_eval


class ViT(nn.Module):
    def __init__(self, img_size=(256, 192), patch=16, dim=1024, depth=24, heads=16, drop_path=0.5, grad_ckpt=True):
        super().__init__()
        self.patch_embed = PatchEmbed(img_size, patch, 3, dim, padding=2)
        self.grid = self.patch_embed.grid_size
        self.pos_embed = nn.Parameter(torch.zeros(1, self.grid[0] * self.grid[1] + 1, dim))
        dpr = [x.item() for x in torch.linspace(0, drop_path, depth)]
        self.blocks = nn.ModuleList([Block(dim, heads, mlp_ratio=4, qkv_bias=True, drop_path=dpr[i]) for i in range(depth)])
        self.last_norm = nn.LayerNorm(dim, eps=1e-6)
        self.grad_ckpt = grad_ckpt
        nn.init.trunc_normal_(self.pos_embed, std=0.02)

    def forward(self, x):
        b = x.shape[0]
        x = self.patch_embed(x)
        # pretrained pos_embed has a cls slot; ViTPose adds it to every token
        x = x + self.pos_embed[:, 1:] + self.pos_embed[:, :1]
        for blk in self.blocks:
            if self.grad_ckpt and self.training:
                x = checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
        x = self.last_norm(x)
        return x.transpose(1, 2).reshape(b, -1, *self.grid)


class ClassicDecoder(nn.Module):
    def __init__(self, in_ch=1024, ch=256, num_joints=17):
        super().__init__()
        self.deconv = nn.Sequential(
            nn.ConvTranspose2d(in_ch, ch, 4, 2, 1, bias=False), nn.BatchNorm2d(ch), nn.ReLU(inplace=True),
            nn.ConvTranspose2d(ch, ch, 4, 2, 1, bias=False), nn.BatchNorm2d(ch), nn.ReLU(inplace=True))
        self.final = nn.Conv2d(ch, num_joints, 1)

    def forward(self, x):
        return self.final(self.deconv(x))


class ViTPose(nn.Module):
    def __init__(self, grad_ckpt=True):
        super().__init__()
        self.backbone = ViT(grad_ckpt=grad_ckpt)
        self.keypoint_head = ClassicDecoder()

    def forward(self, x):
        return self.keypoint_head(self.backbone(x))


def param_groups_layer_decay(model, lr, wd, decay):
    n = len(model.backbone.blocks) + 1
    groups = {}
    for name, p in model.named_parameters():
        if name.startswith("backbone.blocks."):
            lid = int(name.split(".")[2]) + 1
        elif name.startswith(("backbone.patch_embed", "backbone.pos_embed")):
            lid = 0
        else:
            lid = n
        no_decay = p.ndim == 1 or "pos_embed" in name
        key = f"{lid}_{'no' if no_decay else ''}wd"
        if key not in groups:
            groups[key] = {"params": [], "lr": lr * decay ** (n - lid), "weight_decay": 0.0 if no_decay else wd}
        groups[key]["params"].append(p)
    return list(groups.values())


def load_mae(model, path):
    sd = torch.load(path, map_location="cpu")
    sd = sd.get("model", sd)
    sd = {k.replace("module.", "", 1): v for k, v in sd.items()}
    sd = {k: v for k, v in sd.items() if not k.startswith(("head.", "norm.", "cls_token", "decoder"))}
    missing, unexpected = model.backbone.load_state_dict(sd, strict=False)
    return missing, unexpected


@torch.no_grad()
def evaluate(model, loader, ann_file, out_dir, tag):
    model.eval()
    res = []
    for b in loader:
        img = b["img"].cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            hm = model(img)
            hm_f = model(img.flip(3)).flip(3)
        hm_f = hm_f[:, FLIP_PAIRS]
        hm = ((hm + hm_f) / 2).float().cpu().numpy()
        preds, maxvals = get_final_preds(hm, b["center"].numpy(), b["scale"].numpy(), post_process="udp")
        for i in range(len(preds)):
            res.append((int(b["idx"][i]), int(b["image_id"][i]), np.concatenate([preds[i], maxvals[i]], 1),
                        float(b["bbox_score"][i]), float(b["area"][i])))
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(res, gathered, dst=0)
    if dist.get_rank() != 0:
        return None
    uniq = {r[0]: r for part in gathered for r in part}  # drop the sampler's padded repeats
    return coco_oks_eval(ann_file, list(uniq.values()), os.path.join(out_dir, f"pred_{tag}.json"),
                         use_oks_nms=True, nms_thr=0.9)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-root", default="data/coco")
    ap.add_argument("--pretrained", required=True)
    ap.add_argument("--out", default="work_dirs/vitpose_l")
    ap.add_argument("--batch-per-gpu", type=int, default=32)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--base-lr", type=float, default=5e-4, help="for a global batch of 512")
    ap.add_argument("--layer-decay", type=float, default=0.8)
    ap.add_argument("--epochs", type=int, default=210)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    global_batch = args.batch_per_gpu * args.accum * world
    lr = args.base_lr * global_batch / 512

    train_ds = COCOTopDownDataset(args.data_root, "train2017", (256, 192), train=True, udp=True)
    val_ds = COCOTopDownDataset(args.data_root, "val2017", (256, 192), train=False, udp=True, det_boxes=True)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, args.batch_per_gpu, sampler=sampler, num_workers=8, pin_memory=True,
                        drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, 64, sampler=DistributedSampler(val_ds, shuffle=False), num_workers=8)

    net = ViTPose(grad_ckpt=True)
    missing, _ = load_mae(net, args.pretrained)
    if rank == 0:
        print(f"global batch {global_batch}, lr {lr:.2e}; missing keys from MAE: {missing}", flush=True)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).cuda()
    optimizer = torch.optim.AdamW(param_groups_layer_decay(net, lr, 0.1, args.layer_decay), betas=(0.9, 0.999))
    model = DDP(net, device_ids=[local_rank])

    steps_per_epoch = len(loader) // args.accum
    warmup = 500

    def lr_factor(step):
        ep = step / steps_per_epoch
        return min(1.0, (step + 1) / warmup) * (0.1 if ep >= 170 else 1.0) * (0.1 if ep >= 200 else 1.0)

    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        optimizer.zero_grad(set_to_none=True)
        for i, b in enumerate(loader):
            img = b["img"].cuda(non_blocking=True)
            target = b["target"].cuda(non_blocking=True)
            tw = b["target_weight"].cuda(non_blocking=True)
            last_micro = (i + 1) % args.accum == 0
            ctx = model.no_sync() if not last_micro else contextlib.nullcontext()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    out = model(img)
                loss = 0.5 * F.mse_loss(out.float() * tw[..., None], target * tw[..., None]) / args.accum
                loss.backward()
            if last_micro:
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                sched.step()
                optimizer.zero_grad(set_to_none=True)
            if rank == 0 and i % 200 == 0:
                print(f"ep {epoch} {i}/{len(loader)} loss {loss.item() * args.accum:.6f} "
                      f"{time.time() - t0:.0f}s", flush=True)

        if (epoch + 1) % 10 == 0:
            stats = evaluate(model, val_loader, val_ds.ann_file, args.out, epoch + 1)
            if rank == 0:
                print(f"epoch {epoch + 1}: {json.dumps(stats)}", flush=True)
                if stats["AP"] > best:
                    best = stats["AP"]
                    torch.save(model.module.state_dict(), os.path.join(args.out, "best_AP.pth"))
        if rank == 0:
            torch.save({"epoch": epoch + 1, "state_dict": model.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "scheduler": sched.state_dict()},
                       os.path.join(args.out, "latest.pth"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
