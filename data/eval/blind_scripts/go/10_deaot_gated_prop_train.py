"""DeAOT-style training: identity bank + gated propagation, all objects of a video propagated jointly.

Stage: PRE_YTB_DAV (YouTube-VOS 2019 + DAVIS 2017 train), evaluated on DAVIS 2017 val (J&F).

    torchrun --nproc_per_node=8 10_deaot_gated_prop_train.py --cfg configs/deaot_convnext_s.yaml
"""
import argparse
import os
import random
from dataclasses import dataclass, fields

import cv2
import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
import yaml
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset, DistributedSampler


@dataclass
class Cfg:
    ytb_root: str = "/data/YTB/2019/train"
    davis_root: str = "/data/DAVIS/2017/trainval"
    out_dir: str = "results/deaot_convnext_s"
    backbone: str = "convnext_small.fb_in22k"
    max_obj: int = 10
    seq_len: int = 5
    crop: int = 448
    batch_size: int = 2
    num_workers: int = 8
    total_steps: int = 100000
    lr: float = 2e-4
    min_lr: float = 2e-5
    warmup: int = 2000
    weight_decay: float = 0.07
    gp_layers: int = 3
    eval_every: int = 10000
    mem_every: int = 5


def load_cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    a = ap.parse_args()
    cfg = Cfg()
    if a.cfg:
        for k, v in (yaml.safe_load(open(a.cfg)) or {}).items():
            if k not in {f.name for f in fields(Cfg)}:
                raise KeyError(f"unknown config key {k}")
            setattr(cfg, k, v)
    return cfg


def load_rgb(path):
    x = np.asarray(Image.open(path).convert("RGB"), dtype=np.float32) / 255.0
    return torch.from_numpy(((x - [0.485, 0.456, 0.406]) / [0.229, 0.224, 0.225]).astype(np.float32)).permute(2, 0, 1)


class SeqDataset(Dataset):
    def __init__(self, img_root, ann_root, cfg: Cfg, repeat=1, subset=None):
        self.img_root, self.ann_root, self.cfg = img_root, ann_root, cfg
        vids = [v for v in sorted(os.listdir(ann_root))
                if (subset is None or v in subset) and len(os.listdir(os.path.join(ann_root, v))) >= cfg.seq_len]
        self.vids = vids * repeat

    def __len__(self):
        return len(self.vids)

    def __getitem__(self, i):
        v, c = self.vids[i], self.cfg
        names = sorted(f[:-4] for f in os.listdir(os.path.join(self.ann_root, v)))
        ref = random.randint(0, len(names) - c.seq_len)
        rest = sorted(random.sample(range(ref + 1, min(len(names), ref + 1 + 4 * c.seq_len)), c.seq_len - 1))
        idx = [ref] + rest
        rgb = torch.stack([load_rgb(os.path.join(self.img_root, v, names[j] + ".jpg")) for j in idx])
        lab = torch.from_numpy(np.stack([np.asarray(Image.open(os.path.join(self.ann_root, v, names[j] + ".png")))
                                         for j in idx]).astype(np.int64))
        H, W = lab.shape[-2:]
        s = c.crop / min(H, W) * random.uniform(0.9, 1.3)
        nh, nw = max(c.crop, int(H * s)), max(c.crop, int(W * s))
        rgb = F.interpolate(rgb, size=(nh, nw), mode="bilinear", align_corners=False)
        lab = F.interpolate(lab[:, None].float(), size=(nh, nw), mode="nearest")[:, 0].long()
        y, x = random.randint(0, nh - c.crop), random.randint(0, nw - c.crop)
        rgb, lab = rgb[..., y:y + c.crop, x:x + c.crop], lab[..., y:y + c.crop, x:x + c.crop]
        ids = [o for o in lab[0].unique().tolist() if o not in (0, 255)]
        random.shuffle(ids)
        out = torch.zeros_like(lab)
        for n, o in enumerate(ids[: c.max_obj], start=1):
            out[lab == o] = n
        return rgb, out, min(len(ids), c.max_obj)


class GatedPropagation(nn.Module):
    def __init__(self, d, heads=8):
        super().__init__()
        self.norm_self, self.norm_long, self.norm_short, self.norm_ff = (nn.LayerNorm(d) for _ in range(4))
        self.self_attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.long_attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.short_attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.gate = nn.Linear(d, d)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x, pos, lk, lv, sk, sv):
        q = self.norm_self(x) + pos
        x = x + self.self_attn(q, q, self.norm_self(x), need_weights=False)[0]
        g = torch.sigmoid(self.gate(x))
        x = x + g * self.long_attn(self.norm_long(x) + pos, lk, lv, need_weights=False)[0]
        x = x + g * self.short_attn(self.norm_short(x) + pos, sk, sv, need_weights=False)[0]
        return x + self.ff(self.norm_ff(x))


class DeAOT(nn.Module):
    def __init__(self, cfg: Cfg, d=256):
        super().__init__()
        self.max_obj = cfg.max_obj
        self.backbone = timm.create_model(cfg.backbone, pretrained=True, features_only=True, out_indices=(0, 1, 2))
        c4, c8, c16 = self.backbone.feature_info.channels()
        self.proj = nn.Conv2d(c16, d, 1)
        self.id_bank = nn.Conv2d(cfg.max_obj + 1, d, 17, 16, 8)
        self.pos = nn.Parameter(torch.randn(1, d, 32, 32) * 0.02)
        self.layers = nn.ModuleList([GatedPropagation(d) for _ in range(cfg.gp_layers)])
        self.lat8, self.lat4 = nn.Conv2d(c8, 128, 1), nn.Conv2d(c4, 64, 1)
        self.dec16 = nn.Sequential(nn.Conv2d(d, 128, 3, padding=1), nn.GroupNorm(8, 128), nn.GELU())
        self.dec8 = nn.Sequential(nn.Conv2d(128, 64, 3, padding=1), nn.GroupNorm(8, 64), nn.GELU())
        self.cls = nn.Conv2d(64, cfg.max_obj + 1, 3, padding=1)

    def encode(self, x):
        f4, f8, f16 = self.backbone(x)
        return self.proj(f16), self.lat8(f8), self.lat4(f4)

    def kv(self, x16, prob):
        return x16.flatten(2).transpose(1, 2), (x16 + self.id_bank(prob)).flatten(2).transpose(1, 2)

    def decode(self, x16, f8, f4, lk, lv, sk, sv, size):
        n, d, h, w = x16.shape
        pos = F.interpolate(self.pos, size=(h, w), mode="bilinear", align_corners=False).flatten(2).transpose(1, 2)
        x = x16.flatten(2).transpose(1, 2)
        for layer in self.layers:
            x = layer(x, pos, lk, lv, sk, sv)
        x = self.dec16(x.transpose(1, 2).reshape(n, d, h, w))
        x = self.dec8(F.interpolate(x, size=f8.shape[-2:], mode="bilinear", align_corners=False) + f8)
        x = F.interpolate(x, size=f4.shape[-2:], mode="bilinear", align_corners=False) + f4
        return F.interpolate(self.cls(x), size=size, mode="bilinear", align_corners=False)

    def forward(self, rgb, lab, n_obj):
        B, T, _, H, W = rgb.shape
        x16, f8, f4 = (z.view(B, T, *z.shape[1:]) for z in self.encode(rgb.flatten(0, 1)))
        keep = torch.arange(self.max_obj + 1, device=rgb.device)[None] <= n_obj[:, None]
        lk, lv = self.kv(x16[:, 0], F.one_hot(lab[:, 0], self.max_obj + 1).permute(0, 3, 1, 2).float())
        sk, sv = lk, lv
        outs = []
        for t in range(1, T):
            logits = self.decode(x16[:, t], f8[:, t], f4[:, t], lk, lv, sk, sv, (H, W))
            logits = logits.masked_fill(~keep[:, :, None, None], -1e4)
            outs.append(logits)
            sk, sv = self.kv(x16[:, t], logits.softmax(1))
        return torch.stack(outs, 1)


def loss_fn(logits, lab, n_obj):
    C = logits.shape[2]
    ce = F.cross_entropy(logits.flatten(0, 1), lab.flatten(0, 1))
    prob = logits.softmax(2)
    oh = F.one_hot(lab, C).permute(0, 1, 4, 2, 3).float()
    inter, union = (prob * oh).flatten(3).sum(-1), (prob + oh - prob * oh).flatten(3).sum(-1)
    obj = (torch.arange(1, C, device=lab.device)[None] <= n_obj[:, None]).float()[:, None]
    jac = ((1 - (inter[:, :, 1:] + 1) / (union[:, :, 1:] + 1)) * obj).sum() / (obj.sum() * logits.shape[1]).clamp(min=1)
    return ce + jac


def f_measure(pred, gt, bound_pix=3):
    def bmap(m):
        m = m.astype(np.uint8)
        return (m - cv2.erode(m, np.ones((3, 3), np.uint8))) > 0
    kernel = cv2.getStructuringElement(cv2.MORPH_ELLIPSE, (2 * bound_pix + 1, 2 * bound_pix + 1))
    pb, gb = bmap(pred), bmap(gt)
    if pb.sum() == 0 and gb.sum() == 0:
        return 1.0
    gd, pd = cv2.dilate(gb.astype(np.uint8), kernel) > 0, cv2.dilate(pb.astype(np.uint8), kernel) > 0
    prec = (pb & gd).sum() / max(pb.sum(), 1)
    rec = (gb & pd).sum() / max(gb.sum(), 1)
    return 0.0 if prec + rec == 0 else 2 * prec * rec / (prec + rec)


@torch.no_grad()
def evaluate(net, cfg, device, rank, world):
    root = cfg.davis_root
    vids = open(os.path.join(root, "ImageSets/2017/val.txt")).read().split()
    j_sum = f_sum = n_obj = 0.0
    net.eval()
    for v in vids[rank::world]:
        names = sorted(f[:-4] for f in os.listdir(os.path.join(root, "JPEGImages/480p", v)))
        gts = np.stack([np.asarray(Image.open(os.path.join(root, "Annotations/480p", v, n + ".png"))) for n in names])
        K, (H, W) = int(gts[0].max()), gts.shape[1:]
        pad = (0, (-W) % 32, 0, (-H) % 32)
        lk, lv, short, preds = [], [], None, [gts[0]]
        for t, n in enumerate(names):
            img = F.pad(load_rgb(os.path.join(root, "JPEGImages/480p", v, n + ".jpg"))[None].to(device), pad)
            x16, f8, f4 = net.encode(img)
            if t == 0:
                prob = F.pad(F.one_hot(torch.from_numpy(gts[0]).long().to(device), net.max_obj + 1)
                             .permute(2, 0, 1)[None].float(), pad)
            else:
                logits = net.decode(x16, f8, f4, torch.cat(lk, 1), torch.cat(lv, 1), *short, img.shape[-2:])
                logits[:, K + 1:] = -1e4
                prob = logits.softmax(1)
                preds.append(prob[0, :, :H, :W].argmax(0).cpu().numpy())
            short = net.kv(x16, prob)
            if t % cfg.mem_every == 0:
                lk.append(short[0])
                lv.append(short[1])
        pred = np.stack(preds)
        for k in range(1, K + 1):
            p, g = pred == k, gts == k
            js, fs = [], []
            for t in range(1, len(names) - 1):
                u = (p[t] | g[t]).sum()
                js.append(1.0 if u == 0 else (p[t] & g[t]).sum() / u)
                fs.append(f_measure(p[t], g[t]))
            j_sum += float(np.mean(js))
            f_sum += float(np.mean(fs))
            n_obj += 1
    net.train()
    stats = torch.tensor([j_sum, f_sum, n_obj], dtype=torch.float64)
    dist.all_reduce(stats)
    j, f = (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()
    return j, f


def main():
    cfg = load_cfg()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(2023)
    random.seed(2023 + rank)

    net = DeAOT(cfg).to(device)
    model = DDP(net, device_ids=[local_rank])
    decay, no_decay = [], []
    for n, p in net.named_parameters():
        (no_decay if p.ndim <= 1 or n.endswith("pos") else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr)

    def lr_at(step):
        if step < cfg.warmup:
            return cfg.lr * (step + 1) / cfg.warmup
        return cfg.min_lr + (cfg.lr - cfg.min_lr) * (1 - (step - cfg.warmup) / (cfg.total_steps - cfg.warmup)) ** 0.9

    train_set = ConcatDataset([
        SeqDataset(os.path.join(cfg.ytb_root, "JPEGImages"), os.path.join(cfg.ytb_root, "Annotations"), cfg),
        SeqDataset(os.path.join(cfg.davis_root, "JPEGImages/480p"), os.path.join(cfg.davis_root, "Annotations/480p"), cfg, repeat=5,
                   subset=set(open(os.path.join(cfg.davis_root, "ImageSets/2017/train.txt")).read().split())),
    ])
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=sampler, num_workers=cfg.num_workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        wandb.init(project="deaot", name=os.path.basename(cfg.out_dir), config=vars(cfg))

    step, epoch = 0, 0
    while step < cfg.total_steps:
        sampler.set_epoch(epoch)
        for rgb, lab, n_obj in loader:
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            rgb, lab, n_obj = rgb.to(device, non_blocking=True), lab.to(device, non_blocking=True), n_obj.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(rgb, lab, n_obj)
            loss = loss_fn(logits.float(), lab[:, 1:], n_obj)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            step += 1
            if rank == 0 and step % 50 == 0:
                wandb.log({"train/loss": loss.item(), "lr": lr_at(step)}, step=step)
            if step % cfg.eval_every == 0 or step == cfg.total_steps:
                j, f = evaluate(net, cfg, device, rank, world)
                if rank == 0:
                    wandb.log({"val/J": j, "val/F": f, "val/J&F": (j + f) / 2}, step=step)
                    torch.save({"backbone": net.backbone.state_dict(),
                                "propagation": {k: v for k, v in net.state_dict().items() if not k.startswith("backbone.")},
                                "step": step}, os.path.join(cfg.out_dir, f"save_step_{step}.pth"))
            if step >= cfg.total_steps:
                break
        epoch += 1
    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
