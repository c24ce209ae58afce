"""
Full fine-tuning of a SAM2-large-like video segmenter (ViT-L image encoder + memory attention)
with FSDP; the optimizer state of the full model does not fit next to the activations on one GPU.

    torchrun --nnodes=1 --nproc_per_node=8 ft_sam2_large_fsdp.py --train_root /data/sav_subset \
        --val_root /data/DAVIS --out /shared/exp/sam2l_fsdp
"""
import argparse
import functools
import math
import os
import random
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from timm.models.vision_transformer import Block
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train_root", required=True)
    p.add_argument("--val_root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--init", default="")
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--clip_len", type=int, default=8)
    p.add_argument("--eval_len", type=int, default=24, help="frames per val sequence (quick val)")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--lr", type=float, default=4e-6)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def load_img(path, size):
    im = Image.open(path).convert("RGB").resize((size, size), Image.BILINEAR)
    return (torch.from_numpy(np.array(im)).permute(2, 0, 1).float() / 255.0 - MEAN) / STD


def load_ann(path, size):
    return np.array(Image.open(path).resize((size, size), Image.NEAREST))


class TrainClips(Dataset):
    def __init__(self, root, clip_len, size):
        self.root, self.clip_len, self.size = root, clip_len, size
        self.videos = []
        for v in sorted(os.listdir(os.path.join(root, "Annotations"))):
            n = sorted(f[:-4] for f in os.listdir(os.path.join(root, "Annotations", v)))
            if len(n) >= clip_len:
                self.videos.append((v, n))

    def __len__(self):
        return len(self.videos)

    def __getitem__(self, i):
        v, names = self.videos[i]
        step = random.choice([1, 2, 3]) if len(names) >= 3 * self.clip_len else 1
        s = random.randint(0, len(names) - step * (self.clip_len - 1) - 1)
        sel = names[s:s + step * self.clip_len:step]
        imgs = torch.stack([load_img(os.path.join(self.root, "JPEGImages", v, n + ".jpg"), self.size) for n in sel])
        anns = np.stack([load_ann(os.path.join(self.root, "Annotations", v, n + ".png"), self.size) for n in sel])
        ids = [o for o in np.unique(anns[0]) if o != 0]
        o = random.choice(ids) if ids else -1
        return imgs, torch.from_numpy((anns == o).astype(np.float32))


class ValObjects(Dataset):
    """One item per (sequence, object): first `eval_len` frames, prompted with the first-frame mask."""

    def __init__(self, root, eval_len, size):
        self.root, self.eval_len, self.size = root, eval_len, size
        self.items = []
        for seq in open(os.path.join(root, "ImageSets/2017/val.txt")).read().split():
            first = load_ann(os.path.join(root, "Annotations/480p", seq, "00000.png"), size)
            self.items += [(seq, int(o)) for o in np.unique(first) if o != 0]
        self.seqs = sorted({s for s, _ in self.items})

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        seq, o = self.items[i]
        names = sorted(os.listdir(os.path.join(self.root, "JPEGImages/480p", seq)))[: self.eval_len]
        imgs = torch.stack([load_img(os.path.join(self.root, "JPEGImages/480p", seq, n), self.size) for n in names])
        anns = np.stack([load_ann(os.path.join(self.root, "Annotations/480p", seq, n[:-4] + ".png"), self.size) for n in names])
        return imgs, torch.from_numpy((anns == o).astype(np.float32)), i


class MemAttn(nn.Module):
    def __init__(self, dim=256, mem_dim=64, heads=8):
        super().__init__()
        self.n1, self.n2, self.n3 = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.sa = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ca = nn.MultiheadAttention(dim, heads, kdim=mem_dim, vdim=mem_dim, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 2048), nn.GELU(), nn.Linear(2048, dim))

    def forward(self, x, mem):
        h = self.n1(x)
        x = x + self.sa(h, h, h, need_weights=False)[0]
        x = x + self.ca(self.n2(x), mem, mem, need_weights=False)[0]
        return x + self.mlp(self.n3(x))


class SAM2Large(nn.Module):
    def __init__(self, dim=256, n_mem=7):
        super().__init__()
        self.vit = timm.create_model("vit_large_patch16_224.mae", pretrained=True, num_classes=0, dynamic_img_size=True)
        self.neck = nn.Conv2d(1024, dim, 1)
        self.mask_embed = nn.Sequential(nn.Conv2d(1, 32, 4, 4), nn.GELU(), nn.Conv2d(32, dim, 4, 4))
        self.mem_layers = nn.ModuleList([MemAttn(dim) for _ in range(4)])
        self.no_mem = nn.Parameter(torch.zeros(1, 1, 64))
        self.mem_enc = nn.Sequential(nn.Conv2d(dim + 1, dim, 3, padding=1), nn.GELU(), nn.Conv2d(dim, 64, 1))
        self.head = nn.Sequential(nn.ConvTranspose2d(dim, 64, 4, 4), nn.GELU(), nn.Conv2d(64, 1, 3, padding=1))
        self.n_mem = n_mem

    def forward(self, frames, mask0):
        B, T = frames.shape[:2]
        tok = self.vit.forward_features(frames.flatten(0, 1))[:, self.vit.num_prefix_tokens:]
        s = frames.shape[-1] // 16
        feats = self.neck(tok.transpose(1, 2).reshape(B * T, -1, s, s)).unflatten(0, (B, T))
        bank, outs = [], []
        for t in range(T):
            f = feats[:, t] + (self.mask_embed(mask0[:, None]) if t == 0 else 0)
            x = f.flatten(2).transpose(1, 2)
            mem = torch.cat(bank[-self.n_mem:], 1) if bank else self.no_mem.expand(B, -1, -1)
            for layer in self.mem_layers:
                x = layer(x, mem)
            x = x.transpose(1, 2).reshape_as(f)
            logit = self.head(x)
            m = mask0[:, None] if t == 0 else torch.sigmoid(logit)
            m = F.interpolate(m, size=x.shape[-2:], mode="bilinear", align_corners=False)
            bank.append(self.mem_enc(torch.cat([x, m], 1)).flatten(2).transpose(1, 2))
            if t > 0:
                outs.append(logit[:, 0])
        return torch.stack(outs, 1)


def jf(pred, gt):
    u = (pred | gt).sum()
    j = 1.0 if u == 0 else (pred & gt).sum() / u
    t = torch.from_numpy(np.stack([pred, gt]).astype(np.float32))[:, None]
    e = (t + F.max_pool2d(-t, 3, 1, 1)) > 0
    d = F.max_pool2d(e.float(), 9, 1, 4) > 0
    if not e.any():
        return j, 1.0
    p = (e[0] & d[1]).sum().item() / max(e[0].sum().item(), 1)
    r = (e[1] & d[0]).sum().item() / max(e[1].sum().item(), 1)
    return j, 0.0 if p + r == 0 else 2 * p * r / (p + r)


@torch.no_grad()
def evaluate(model, val_set, device, world):
    # every rank runs the same number of items (the sampler pads), so the FSDP all-gathers line up
    sampler = DistributedSampler(val_set, shuffle=False)
    loader = DataLoader(val_set, batch_size=1, sampler=sampler, num_workers=4)
    model.eval()
    rows = []
    for imgs, masks, idx in loader:
        logits = model(imgs.to(device), masks[:, 0].to(device))[0]
        pred = F.interpolate(logits[:, None].float(), size=masks.shape[-2:], mode="bilinear")[:, 0] > 0
        pred, gt = pred.cpu().numpy(), masks[0, 1:].numpy() > 0.5
        s = np.mean([jf(p, g) for p, g in zip(pred, gt)], axis=0)
        rows.append([float(idx), s[0], s[1]])
    local = torch.tensor(rows, device=device, dtype=torch.float64)
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    model.train()
    per_item = {int(r[0]): (r[1].item(), r[2].item()) for r in torch.cat(gathered)}
    per_seq = {}
    for i, (j, f) in per_item.items():
        per_seq.setdefault(val_set.items[i][0], []).append((j + f) / 2)
    return float(np.mean([np.mean(v) for v in per_seq.values()]))


def save_checkpoint(model, epoch, out, rank):
    if rank == 0:
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            state = model.state_dict()
        torch.save({"model": state, "epoch": epoch}, os.path.join(out, f"sam2l_ep{epoch:02d}.pt"))
    dist.barrier()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    net = SAM2Large()
    if args.init:
        net.load_state_dict(torch.load(args.init, map_location="cpu"), strict=False)
    wrap = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block, MemAttn})
    model = FSDP(net, auto_wrap_policy=wrap, sharding_strategy=ShardingStrategy.FULL_SHARD,
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16),
                 device_id=local_rank, use_orig_params=True, limit_all_gathers=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05, betas=(0.9, 0.999))

    train_set = TrainClips(args.train_root, args.clip_len, args.size)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=1, sampler=sampler, num_workers=args.workers, pin_memory=True, drop_last=True)
    val_set = ValObjects(args.val_root, args.eval_len, args.size)
    total = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 500) * 0.5 * (1 + math.cos(math.pi * s / total)))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (frames, masks) in enumerate(loader):
            frames, masks = frames.to(device, non_blocking=True), masks.to(device, non_blocking=True)
            logits = model(frames, masks[:, 0]).float()
            tgt = F.interpolate(masks[:, 1:], size=logits.shape[-2:], mode="nearest")
            p = torch.sigmoid(logits)
            loss = F.binary_cross_entropy_with_logits(logits, tgt) + \
                (1 - (2 * (p * tgt).flatten(2).sum(-1) + 1) / (p.flatten(2).sum(-1) + tgt.flatten(2).sum(-1) + 1)).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(0.1)
            opt.step()
            sched.step()
            if rank == 0 and it % 20 == 0:
                print(f"[ep {epoch} {it}/{len(loader)}] loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                      f"mem {torch.cuda.max_memory_allocated() / 2**30:.1f}G {time.time() - t0:.0f}s", flush=True)

        score = evaluate(model, val_set, device, world)
        if rank == 0:
            print(f"epoch {epoch}: quick-val J&F {score:.4f}", flush=True)
        save_checkpoint(model, epoch, args.out, rank)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
