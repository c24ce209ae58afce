"""
Video fine-tuning of a SAM2-like model (image encoder + memory attention + memory encoder)
on SA-V / MOSE style clips. Memory attention layers are activation-checkpointed because
they run once per frame and dominate activation memory for 16-frame clips.

    torchrun --nproc_per_node=8 sam2_video_ft.py --cfg configs/sam2_b_video_ft.yaml
"""
import argparse
import collections
import csv
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
import torch.utils.checkpoint as cp
import yaml
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

DEFAULTS = dict(
    train_root="data/sav_train_subset", val_root="data/DAVIS", out_dir="outputs/sam2_video_ft",
    image_size=512, clip_len=16, batch_per_gpu=1, epochs=40, lr=5e-6, wd=0.01, warmup_epochs=1,
    num_maskmem=7, mem_layers=4, dim=256, workers=8, grad_ckpt=True, init="", val_every=5, seed=123,
)


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    args, rest = ap.parse_known_args()
    cfg = dict(DEFAULTS)
    if args.cfg:
        with open(args.cfg) as f:
            cfg.update(yaml.safe_load(f) or {})
    for item in rest:
        k, v = item.lstrip("-").split("=")
        cfg[k] = type(DEFAULTS[k])(v) if not isinstance(DEFAULTS[k], bool) else v.lower() in ("1", "true")
    return argparse.Namespace(**cfg)


def img_to_tensor(path, size):
    im = Image.open(path).convert("RGB").resize((size, size), Image.BILINEAR)
    t = torch.as_tensor(np.array(im), dtype=torch.float32).permute(2, 0, 1) / 255.0
    return (t - torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)) / torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


class SAVClips(Dataset):
    def __init__(self, root, clip_len, size):
        self.root, self.clip_len, self.size = root, clip_len, size
        self.samples = []
        for vid in sorted(os.listdir(os.path.join(root, "Annotations"))):
            frames = sorted(os.listdir(os.path.join(root, "Annotations", vid)))
            if len(frames) >= clip_len:
                self.samples.append((vid, [f[:-4] for f in frames]))

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        vid, frames = self.samples[i]
        s = random.randint(0, len(frames) - self.clip_len)
        sel = frames[s:s + self.clip_len]
        if random.random() < 0.5:
            sel = sel[::-1]
        imgs = torch.stack([img_to_tensor(os.path.join(self.root, "JPEGImages", vid, f + ".jpg"), self.size) for f in sel])
        anns = np.stack([np.array(Image.open(os.path.join(self.root, "Annotations", vid, f + ".png")).resize((self.size, self.size), Image.NEAREST)) for f in sel])
        ids = [o for o in np.unique(anns[0]) if o != 0]
        oid = random.choice(ids) if ids else 1
        return imgs, torch.from_numpy((anns == oid).astype(np.float32))


class MemoryAttentionLayer(nn.Module):
    def __init__(self, dim, heads=8):
        super().__init__()
        self.n1, self.n2, self.n3 = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.self_attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.cross_attn = nn.MultiheadAttention(dim, heads, kdim=64, vdim=64, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 2048), nn.GELU(), nn.Linear(2048, dim))

    def forward(self, x, mem, pos):
        h = self.n1(x) + pos
        x = x + self.self_attn(h, h, self.n1(x), need_weights=False)[0]
        x = x + self.cross_attn(self.n2(x) + pos, mem, mem, need_weights=False)[0]
        return x + self.mlp(self.n3(x))


class VideoSAM(nn.Module):
    def __init__(self, dim=256, num_maskmem=7, mem_layers=4, grad_ckpt=True):
        super().__init__()
        self.encoder = timm.create_model("vit_base_patch16_224.mae", pretrained=True, num_classes=0, dynamic_img_size=True)
        self.neck = nn.Sequential(nn.Conv2d(768, dim, 1), nn.GroupNorm(32, dim))
        self.pos = nn.Parameter(torch.zeros(1, 32 * 32, dim))
        self.layers = nn.ModuleList([MemoryAttentionLayer(dim) for _ in range(mem_layers)])
        self.no_mem = nn.Parameter(torch.zeros(1, 1, 64))
        self.tpos = nn.Parameter(torch.zeros(num_maskmem, 1, 64))
        self.mask_in = nn.Sequential(nn.Conv2d(1, 16, 4, 4), nn.GELU(), nn.Conv2d(16, dim, 4, 4))
        self.mem_enc = nn.Sequential(nn.Conv2d(dim, dim, 3, padding=1), nn.GroupNorm(32, dim), nn.GELU(), nn.Conv2d(dim, 64, 1))
        self.decoder = nn.Sequential(nn.ConvTranspose2d(dim, 128, 2, 2), nn.GroupNorm(16, 128), nn.GELU(),
                                     nn.ConvTranspose2d(128, 64, 2, 2), nn.GELU(), nn.Conv2d(64, 1, 1))
        self.num_maskmem = num_maskmem
        self.grad_ckpt = grad_ckpt

    def embed(self, frames):
        tok = self.encoder.forward_features(frames)[:, self.encoder.num_prefix_tokens:]
        s = frames.shape[-1] // 16
        return self.neck(tok.transpose(1, 2).reshape(frames.shape[0], -1, s, s))

    def attend(self, feat, memory):
        b, c, h, w = feat.shape
        x = feat.flatten(2).transpose(1, 2)
        pos = F.interpolate(self.pos.transpose(1, 2).reshape(1, c, 32, 32), size=(h, w), mode="bilinear",
                            align_corners=False).flatten(2).transpose(1, 2)
        for layer in self.layers:
            if self.grad_ckpt and self.training:
                x = cp.checkpoint(layer, x, memory, pos)
            else:
                x = layer(x, memory, pos)
        return x.transpose(1, 2).reshape(b, c, h, w)

    def encode_memory(self, feat, mask_logits):
        m = torch.sigmoid(F.interpolate(mask_logits, size=feat.shape[-2:], mode="bilinear", align_corners=False))
        return self.mem_enc(feat * m + feat).flatten(2).transpose(1, 2)

    def forward(self, frames, first_mask):
        """frames: B T 3 H W, first_mask: B H W. Returns logits B T-1 H/4 W/4 for frames 1..T-1."""
        B, T = frames.shape[:2]
        feats = self.embed(frames.flatten(0, 1)).unflatten(0, (B, T))
        f0 = feats[:, 0] + self.mask_in(first_mask[:, None])
        bank = collections.deque([self.encode_memory(self.attend(f0, self.no_mem.expand(B, 1, -1)), first_mask[:, None] * 20 - 10)],
                                 maxlen=self.num_maskmem)
        outs = []
        for t in range(1, T):
            mem = torch.cat([m + self.tpos[len(bank) - 1 - i] for i, m in enumerate(bank)], 1)
            cond = self.attend(feats[:, t], mem)
            logit = self.decoder(cond)
            outs.append(logit[:, 0])
            bank.append(self.encode_memory(cond, logit))
        return torch.stack(outs, 1)


def j_f(pred, gt):
    union = np.logical_or(pred, gt).sum()
    j = 1.0 if union == 0 else np.logical_and(pred, gt).sum() / union
    t = torch.from_numpy(np.stack([pred, gt]).astype(np.float32))[:, None]
    edge = (t + F.max_pool2d(-t, 3, 1, 1)) > 0
    r = max(1, round(0.008 * math.hypot(*gt.shape)))
    dil = F.max_pool2d(edge.float(), 2 * r + 1, 1, r) > 0
    pe, ge = edge[0, 0], edge[1, 0]
    if pe.sum() == 0 and ge.sum() == 0:
        return j, 1.0
    prec = (pe & dil[1, 0]).sum().item() / max(pe.sum().item(), 1)
    rec = (ge & dil[0, 0]).sum().item() / max(ge.sum().item(), 1)
    return j, 0.0 if prec + rec == 0 else 2 * prec * rec / (prec + rec)


@torch.no_grad()
def evaluate(net, cfg, device, rank, world):
    net.eval()
    seqs = open(os.path.join(cfg.val_root, "ImageSets/2017/val.txt")).read().split()
    acc = torch.zeros(3, device=device)
    for seq in seqs[rank::world]:
        names = sorted(os.listdir(os.path.join(cfg.val_root, "JPEGImages/480p", seq)))
        frames = torch.stack([img_to_tensor(os.path.join(cfg.val_root, "JPEGImages/480p", seq, n), cfg.image_size) for n in names]).to(device)
        gts = np.stack([np.array(Image.open(os.path.join(cfg.val_root, "Annotations/480p", seq, n[:-4] + ".png"))
                                 .resize((cfg.image_size, cfg.image_size), Image.NEAREST)) for n in names])
        seq_j, seq_f = [], []
        for o in [o for o in np.unique(gts[0]) if o != 0]:
            m0 = torch.from_numpy((gts[0] == o).astype(np.float32)).to(device)[None]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = net(frames[None], m0)[0]
            pred = F.interpolate(logits[:, None].float(), size=gts.shape[-2:], mode="bilinear")[:, 0] > 0
            for t, p in enumerate(pred.cpu().numpy(), start=1):
                j, f = j_f(p, gts[t] == o)
                seq_j.append(j)
                seq_f.append(f)
        acc += torch.tensor([np.mean(seq_j), np.mean(seq_f), 1.0], device=device)
    dist.all_reduce(acc)
    net.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(cfg.seed + rank)
    np.random.seed(cfg.seed + rank)
    torch.manual_seed(cfg.seed)

    net = VideoSAM(cfg.dim, cfg.num_maskmem, cfg.mem_layers, cfg.grad_ckpt)
    if cfg.init:
        state = torch.load(cfg.init, map_location="cpu")
        net.load_state_dict(state.get("model", state), strict=False)
    model = DDP(net.to(device), device_ids=[local_rank])

    ds = SAVClips(cfg.train_root, cfg.clip_len, cfg.image_size)
    sampler = DistributedSampler(ds, shuffle=True, seed=cfg.seed, drop_last=True)
    dl = DataLoader(ds, batch_size=cfg.batch_per_gpu, sampler=sampler, num_workers=cfg.workers, pin_memory=True, drop_last=True)

    decay = [p for n, p in model.named_parameters() if p.ndim > 1 and "pos" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1 or "pos" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.wd}, {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr)
    total, warm = cfg.epochs * len(dl), cfg.warmup_epochs * len(dl)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: s / max(1, warm) if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, total - warm))))

    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        log_f = open(os.path.join(cfg.out_dir, "log.csv"), "a", newline="")
        log = csv.writer(log_f)

    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, run = time.time(), 0.0
        for it, (frames, masks) in enumerate(dl):
            frames, masks = frames.to(device, non_blocking=True), masks.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(frames, masks[:, 0])
            tgt = F.interpolate(masks[:, 1:], size=logits.shape[-2:], mode="nearest")
            loss = F.binary_cross_entropy_with_logits(logits.float(), tgt)
            prob = torch.sigmoid(logits.float())
            loss = loss + (1 - (2 * (prob * tgt).flatten(2).sum(-1) + 1) / (prob.flatten(2).sum(-1) + tgt.flatten(2).sum(-1) + 1)).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            opt.step()
            sched.step()
            run += loss.item()
            if rank == 0 and (it + 1) % 50 == 0:
                print(f"ep {epoch} it {it + 1}/{len(dl)} loss {run / 50:.4f} {time.time() - t0:.1f}s", flush=True)
                log.writerow([epoch, it + 1, run / 50, sched.get_last_lr()[0]])
                log_f.flush()
                run, t0 = 0.0, time.time()

        if (epoch + 1) % cfg.val_every == 0:
            j, f = evaluate(model.module, cfg, device, rank, world)
            if rank == 0:
                print(f"[val] epoch {epoch}: J {j:.4f} F {f:.4f} J&F {(j + f) / 2:.4f}", flush=True)
                log.writerow([epoch, "val", j, f])
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "epoch": epoch}, os.path.join(cfg.out_dir, f"epoch_{epoch:03d}.pt"))

    if rank == 0:
        log_f.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
