"""AOT-style identification-embedding VOS model, main training on YTVOS+DAVIS with DAVIS-17 val.

torchrun --nproc_per_node=4 train_aot.py --cfg configs/aot_s_pre_ytb_dav.yaml
"""
import argparse
import dataclasses
import os
import random
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import yaml
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.ops import FrozenBatchNorm2d


@dataclass
class Config:
    davis_root: str = "datasets/DAVIS"
    ytb_root: str = "datasets/YTB/2019/train"
    exp: str = "aot_s"
    max_obj: int = 10
    seq_len: int = 5
    crop: int = 465
    batch_per_gpu: int = 4
    lr: float = 2e-4
    min_lr: float = 2e-5
    weight_decay: float = 0.07
    total_steps: int = 100000
    warmup: int = 5000
    eval_every: int = 10000
    workers: int = 8
    dim: int = 256
    n_layers: int = 3
    seed: int = 2022
    ckpt_dir: str = "ckpts"
    resume: str = ""
    milestones: list = field(default_factory=list)


def load_cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default="")
    ap.add_argument("--opts", nargs="*", default=[])
    a = ap.parse_args()
    cfg = Config()
    if a.cfg:
        with open(a.cfg) as f:
            for k, v in yaml.safe_load(f).items():
                setattr(cfg, k, v)
    for kv in a.opts:
        k, v = kv.split("=", 1)
        setattr(cfg, k, type(getattr(cfg, k))(v))
    return cfg


MEAN, STD = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])


def to_tensor(im):
    return torch.from_numpy(((np.asarray(im, np.float32) / 255.0 - MEAN) / STD).astype(np.float32)).permute(2, 0, 1)


class VOSTrain(Dataset):
    def __init__(self, img_dir, ann_dir, seq_len, crop, max_obj, max_gap=5):
        self.img_dir, self.ann_dir = img_dir, ann_dir
        self.seq_len, self.crop, self.max_obj, self.max_gap = seq_len, crop, max_obj, max_gap
        self.seqs = [s for s in sorted(os.listdir(ann_dir)) if len(os.listdir(os.path.join(ann_dir, s))) >= seq_len]

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        seq = self.seqs[i]
        anns = sorted(os.listdir(os.path.join(self.ann_dir, seq)))
        ref = random.randrange(len(anns))
        idx = [ref]
        cur = random.randrange(len(anns))
        for _ in range(self.seq_len - 1):
            idx.append(cur)
            cur = min(len(anns) - 1, cur + random.randint(1, self.max_gap))
        ims = [Image.open(os.path.join(self.img_dir, seq, anns[j][:-4] + ".jpg")).convert("RGB") for j in idx]
        gts = [Image.open(os.path.join(self.ann_dir, seq, anns[j])) for j in idx]
        w, h = ims[0].size
        s = self.crop / min(w, h) * random.uniform(1.0, 1.3)
        nw, nh = int(w * s), int(h * s)
        x0, y0 = random.randint(0, max(0, nw - self.crop)), random.randint(0, max(0, nh - self.crop))
        box = (x0, y0, x0 + self.crop, y0 + self.crop)
        ims = [to_tensor(im.resize((nw, nh), Image.BILINEAR).crop(box)) for im in ims]
        gts = [np.asarray(g.resize((nw, nh), Image.NEAREST).crop(box), dtype=np.int64) for g in gts]
        ids = [o for o in np.unique(gts[0]) if o != 0]
        random.shuffle(ids)
        ids = ids[: self.max_obj]
        remap = np.zeros(256, np.int64)
        for new, old in enumerate(ids, start=1):
            remap[old] = new
        labels = torch.from_numpy(np.stack([remap[np.clip(g, 0, 255)] for g in gts]))
        return torch.stack(ims), labels, len(ids)


class IDAssociation(nn.Module):
    def __init__(self, max_obj=10, dim=256, n_layers=3):
        super().__init__()
        mb = torchvision.models.mobilenet_v2(weights="IMAGENET1K_V1", norm_layer=FrozenBatchNorm2d).features
        self.enc4, self.enc8, self.enc16 = mb[:4], mb[4:7], mb[7:14]
        self.proj = nn.Conv2d(96, dim, 1)
        self.id_bank = nn.Conv2d(max_obj + 1, dim, 17, stride=16, padding=8)
        self.pos = nn.Parameter(torch.zeros(1, dim, 64, 64))
        self.self_attn = nn.ModuleList([nn.MultiheadAttention(dim, 8, batch_first=True) for _ in range(n_layers)])
        self.long_attn = nn.ModuleList([nn.MultiheadAttention(dim, 8, batch_first=True) for _ in range(n_layers)])
        self.ffn = nn.ModuleList([nn.Sequential(nn.Linear(dim, 1024), nn.GELU(), nn.Linear(1024, dim)) for _ in range(n_layers)])
        self.norms = nn.ModuleList([nn.LayerNorm(dim) for _ in range(3 * n_layers)])
        self.dec16 = nn.Sequential(nn.Conv2d(dim, dim, 3, padding=1), nn.GroupNorm(32, dim), nn.ReLU())
        self.dec8 = nn.Sequential(nn.Conv2d(dim + 32, 128, 3, padding=1), nn.GroupNorm(16, 128), nn.ReLU())
        self.dec4 = nn.Sequential(nn.Conv2d(128 + 24, 64, 3, padding=1), nn.GroupNorm(8, 64), nn.ReLU())
        self.cls = nn.Conv2d(64, max_obj + 1, 1)
        self.max_obj = max_obj

    def features(self, x):
        f4 = self.enc4(x)
        f8 = self.enc8(f4)
        f16 = self.proj(self.enc16(f8))
        return f16, f8, f4

    def pos_embed(self, f):
        return F.interpolate(self.pos, size=f.shape[-2:], mode="bilinear", align_corners=False)

    def propagate(self, q16, mem_k, mem_v):
        x = (q16 + self.pos_embed(q16)).flatten(2).transpose(1, 2)
        for i in range(len(self.self_attn)):
            h = self.norms[3 * i](x)
            x = x + self.self_attn[i](h, h, h, need_weights=False)[0]
            h = self.norms[3 * i + 1](x)
            x = x + self.long_attn[i](h, mem_k, mem_v, need_weights=False)[0]
            x = x + self.ffn[i](self.norms[3 * i + 2](x))
        return x.transpose(1, 2).reshape_as(q16)

    def decode(self, x, f8, f4, out_size):
        x = self.dec16(x)
        x = self.dec8(torch.cat([F.interpolate(x, size=f8.shape[-2:], mode="bilinear", align_corners=False), f8], 1))
        x = self.dec4(torch.cat([F.interpolate(x, size=f4.shape[-2:], mode="bilinear", align_corners=False), f4], 1))
        return F.interpolate(self.cls(x), size=out_size, mode="bilinear", align_corners=False)

    def memorize(self, f16, label):
        onehot = F.one_hot(label, self.max_obj + 1).permute(0, 3, 1, 2).float()
        ident = self.id_bank(onehot)
        ident = F.interpolate(ident, size=f16.shape[-2:], mode="bilinear", align_corners=False)
        k = (f16 + self.pos_embed(f16)).flatten(2).transpose(1, 2)
        v = (f16 + ident).flatten(2).transpose(1, 2)
        return k, v

    def forward(self, frames, labels):
        # frames: B T 3 H W, labels: B T H W; frame 0 is the reference with ground truth
        B, T = frames.shape[:2]
        f16, f8, f4 = self.features(frames.flatten(0, 1))
        f16, f8, f4 = [f.view(B, T, *f.shape[1:]) for f in (f16, f8, f4)]
        mk, mv = self.memorize(f16[:, 0], labels[:, 0])
        all_logits = []
        for t in range(1, T):
            logits = self.decode(self.propagate(f16[:, t], mk, mv), f8[:, t], f4[:, t], frames.shape[-2:])
            all_logits.append(logits)
            k, v = self.memorize(f16[:, t], logits.argmax(1).detach())
            mk, mv = torch.cat([mk, k], 1), torch.cat([mv, v], 1)
        return torch.stack(all_logits, 1)


def boundary(m, r):
    t = torch.from_numpy(m.astype(np.float32))[None, None]
    edge = (t - (-F.max_pool2d(-t, 3, 1, 1))).clamp(min=0)
    return edge[0, 0].numpy() > 0, F.max_pool2d(edge, 2 * r + 1, 1, r)[0, 0].numpy() > 0


def seq_j_f(preds, gts, obj_ids):
    js, fs = [], []
    r = max(1, round(0.008 * np.hypot(*gts[0].shape)))
    for o in obj_ids:
        for p, g in zip(preds, gts):
            p, g = p == o, g == o
            u = (p | g).sum()
            js.append(1.0 if u == 0 else (p & g).sum() / u)
            pb, pd = boundary(p, r)
            gb, gd = boundary(g, r)
            if pb.sum() == 0 and gb.sum() == 0:
                fs.append(1.0)
                continue
            prec, rec = (pb & gd).sum() / max(pb.sum(), 1), (gb & pd).sum() / max(gb.sum(), 1)
            fs.append(0.0 if prec + rec == 0 else 2 * prec * rec / (prec + rec))
    return float(np.mean(js)), float(np.mean(fs))


@torch.no_grad()
def evaluate_davis(net, cfg, device, rank, world):
    root = cfg.davis_root
    with open(os.path.join(root, "ImageSets/2017/val.txt")) as f:
        seqs = [l.strip() for l in f if l.strip()]
    j_sum = f_sum = 0.0
    n_seq = 0
    for seq in seqs[rank::world]:
        names = sorted(os.listdir(os.path.join(root, "JPEGImages/480p", seq)))
        gts = [np.asarray(Image.open(os.path.join(root, "Annotations/480p", seq, n[:-4] + ".png"))) for n in names]
        frames = torch.stack([to_tensor(Image.open(os.path.join(root, "JPEGImages/480p", seq, n)).convert("RGB")) for n in names])
        f16, f8, f4 = net.features(frames.to(device))
        lab0 = torch.from_numpy(gts[0].astype(np.int64)).to(device)[None]
        mk, mv = net.memorize(f16[:1], lab0)
        preds = []
        for t in range(1, len(names)):
            logits = net.decode(net.propagate(f16[t:t + 1], mk, mv), f8[t:t + 1], f4[t:t + 1], frames.shape[-2:])
            pred = logits.argmax(1)
            preds.append(pred[0].cpu().numpy())
            if t % 5 == 0:
                k, v = net.memorize(f16[t:t + 1], pred)
                mk, mv = torch.cat([mk, k], 1), torch.cat([mv, v], 1)
        j, fm = seq_j_f(preds, gts[1:], [o for o in np.unique(gts[0]) if o != 0])
        j_sum, f_sum, n_seq = j_sum + j, f_sum + fm, n_seq + 1
    stats = torch.tensor([j_sum, f_sum, n_seq], dtype=torch.float64)
    dist.all_reduce(stats)
    j_mean, f_mean = (stats[:2] / stats[2]).tolist()
    return j_mean, f_mean


def lr_at(step, cfg):
    if step < cfg.warmup:
        return cfg.lr * step / cfg.warmup
    p = (step - cfg.warmup) / max(1, cfg.total_steps - cfg.warmup)
    return (cfg.lr - cfg.min_lr) * (1 - p) ** 0.9 + cfg.min_lr


def main():
    cfg = load_cfg()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(cfg.seed + rank)
    np.random.seed(cfg.seed + rank)
    torch.manual_seed(cfg.seed + rank)
    is_main = rank == 0
    if is_main:
        os.makedirs(os.path.join(cfg.ckpt_dir, cfg.exp), exist_ok=True)
        print(dataclasses.asdict(cfg))

    net = IDAssociation(cfg.max_obj, cfg.dim, cfg.n_layers).to(device)
    step = 0
    if cfg.resume:
        state = torch.load(cfg.resume, map_location="cpu")
        net.load_state_dict(state["model"])
        step = state["step"]
    model = DDP(net, device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.resume:
        opt.load_state_dict(state["opt"])

    train_set = ConcatDataset([
        VOSTrain(os.path.join(cfg.ytb_root, "JPEGImages"), os.path.join(cfg.ytb_root, "Annotations"), cfg.seq_len, cfg.crop, cfg.max_obj),
        VOSTrain(os.path.join(cfg.davis_root, "JPEGImages/480p"), os.path.join(cfg.davis_root, "Annotations/480p"), cfg.seq_len, cfg.crop, cfg.max_obj),
    ])
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed)
    loader = DataLoader(train_set, batch_size=cfg.batch_per_gpu, sampler=sampler, num_workers=cfg.workers,
                        pin_memory=True, drop_last=True)
    scaler = torch.cuda.amp.GradScaler()

    epoch, t0 = 0, time.time()
    while step < cfg.total_steps:
        sampler.set_epoch(epoch)
        for frames, labels, _ in loader:
            frames, labels = frames.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            for g in opt.param_groups:
                g["lr"] = lr_at(step, cfg)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(frames, labels)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), labels[:, 1:].flatten(0, 1))
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(opt)
            scaler.update()
            step += 1
            if is_main and step % 50 == 0:
                print(f"step {step} ep {epoch} loss {loss.item():.4f} lr {lr_at(step, cfg):.2e} {(time.time() - t0) / 50:.2f}s/it")
                t0 = time.time()
            if step % cfg.eval_every == 0 or step == cfg.total_steps:
                model.eval()
                j, f = evaluate_davis(model.module, cfg, device, rank, world)
                model.train()
                if is_main:
                    print(f"[eval] step {step}: J {j:.4f} F {f:.4f} J&F {(j + f) / 2:.4f}")
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step},
                               os.path.join(cfg.ckpt_dir, cfg.exp, f"step_{step}.pth"))
                dist.barrier()
            if step >= cfg.total_steps:
                break
        epoch += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
