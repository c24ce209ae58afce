"""XMem-style fine-tuning on MOSE (complex scenes, many objects), validated on DAVIS-17 val J&F.

    torchrun --nproc_per_node=8 14_xmem_mose_finetune.py train.iterations=80000 data.mose=/data/MOSE/train
"""
import math
import os
import random
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from omegaconf import OmegaConf
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchvision.models import ResNet18_Weights, ResNet50_Weights, resnet18, resnet50
from torchvision.ops import FrozenBatchNorm2d

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)

BASE = OmegaConf.create({
    "data": {"mose": "/data/MOSE/train", "davis": "/data/DAVIS/2017/trainval", "num_frames": 8, "max_objects": 3,
             "max_skip": 5, "size": 384, "workers": 8},
    "train": {"batch_size": 4, "iterations": 80000, "lr": 1e-5, "weight_decay": 0.05, "warmup": 1000,
              "eval_every": 5000, "init": "weights/XMem-s012.pth", "out": "saves/xmem_mose"},
    "model": {"hidden_dim": 64},
    "eval": {"mem_every": 5, "max_mem": 10},
    "wandb": {"project": "xmem-mose", "enabled": True},
})


class MOSEClips(Dataset):
    def __init__(self, root, c):
        self.im_root, self.gt_root, self.c = os.path.join(root, "JPEGImages"), os.path.join(root, "Annotations"), c
        self.videos = []
        for v in sorted(os.listdir(self.gt_root)):
            n = len(os.listdir(os.path.join(self.gt_root, v)))
            if n >= c.num_frames:
                self.videos.append(v)

    def __len__(self):
        return len(self.videos)

    def __getitem__(self, idx):
        c, vid = self.c, self.videos[idx]
        names = sorted(n[:-4] for n in os.listdir(os.path.join(self.gt_root, vid)))
        S, T, K = c.size, c.num_frames, c.max_objects
        for _ in range(5):
            i = [random.randint(0, len(names) - T)]
            for _ in range(T - 1):
                i.append(min(len(names) - 1, i[-1] + random.randint(1, c.max_skip)))
            ims = [Image.open(os.path.join(self.im_root, vid, names[j] + ".jpg")).convert("RGB") for j in i]
            gts = [Image.open(os.path.join(self.gt_root, vid, names[j] + ".png")).convert("P") for j in i]
            w, h = ims[0].size
            s = S / min(w, h) * random.uniform(1.0, 1.4)
            nw, nh = max(S, int(w * s)), max(S, int(h * s))
            x0, y0 = random.randint(0, nw - S), random.randint(0, nh - S)
            box = (x0, y0, x0 + S, y0 + S)
            lab = np.stack([np.asarray(g.resize((nw, nh), Image.NEAREST).crop(box)) for g in gts])
            labels = [l for l in np.unique(lab[0]) if l != 0]
            if labels:
                break
        frames = torch.stack([(torch.from_numpy(np.asarray(im.resize((nw, nh), Image.BILINEAR).crop(box), dtype=np.float32))
                               .permute(2, 0, 1) / 255 - MEAN) / STD for im in ims])
        labels = random.sample(labels, min(K, len(labels)))
        masks = torch.zeros(T, K, S, S)
        selector = torch.zeros(K)
        for k, l in enumerate(labels):
            masks[:, k] = torch.from_numpy(lab == l).float()
            selector[k] = 1
        return frames, masks, selector


def resnet_trunk(depth, in_ch=3):
    net = (resnet50 if depth == 50 else resnet18)(
        weights=ResNet50_Weights.IMAGENET1K_V1 if depth == 50 else ResNet18_Weights.IMAGENET1K_V1,
        norm_layer=FrozenBatchNorm2d)
    if in_ch != 3:
        conv = nn.Conv2d(in_ch, 64, 7, 2, 3, bias=False)
        with torch.no_grad():
            conv.weight.zero_()
            conv.weight[:, :3] = net.conv1.weight
        net.conv1 = conv
    return nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool, net.layer1, net.layer2, net.layer3)


class HiddenUpdater(nn.Module):
    def __init__(self, in_dim, hidden_dim):
        super().__init__()
        self.hidden_dim = hidden_dim
        self.transform = nn.Conv2d(in_dim + hidden_dim, hidden_dim * 3, 3, padding=1)
        nn.init.xavier_normal_(self.transform.weight)

    def forward(self, x, h):
        v = self.transform(torch.cat([x, h], 1))
        d = self.hidden_dim
        forget, update, new = torch.sigmoid(v[:, :d]), torch.sigmoid(v[:, d:2 * d]), torch.tanh(v[:, 2 * d:])
        return forget * h * (1 - update) + update * new


class XMem(nn.Module):
    def __init__(self, hidden_dim=64, key_dim=64, value_dim=512):
        super().__init__()
        self.hidden_dim = hidden_dim
        self.key_encoder = resnet_trunk(50)
        self.key_proj = nn.Conv2d(1024, key_dim, 3, padding=1)
        self.shrinkage_proj = nn.Conv2d(1024, 1, 3, padding=1)
        self.selection_proj = nn.Conv2d(1024, key_dim, 3, padding=1)
        self.value_encoder = resnet_trunk(18, in_ch=5)
        self.value_fuser = nn.Sequential(nn.Conv2d(1024 + 256, value_dim, 3, padding=1), nn.ReLU(inplace=True),
                                         nn.Conv2d(value_dim, value_dim, 3, padding=1))
        self.value_hidden = HiddenUpdater(value_dim, hidden_dim)
        self.decoder_fuser = nn.Sequential(nn.Conv2d(1024 + value_dim + hidden_dim, 512, 3, padding=1),
                                           nn.ReLU(inplace=True), nn.Conv2d(512, 256, 3, padding=1))
        self.decoder_hidden = HiddenUpdater(256, hidden_dim)
        self.pred = nn.Sequential(nn.ReLU(), nn.Conv2d(256, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 1, 3, padding=1))

    def encode_key(self, x):
        f16 = self.key_encoder(x)
        return f16, self.key_proj(f16), self.shrinkage_proj(f16) ** 2 + 1, torch.sigmoid(self.selection_proj(f16))

    def encode_value(self, image, f16, hidden, masks):
        B, K = masks.shape[:2]
        others = masks.sum(1, keepdim=True) - masks
        x = torch.cat([image.unsqueeze(1).expand(-1, K, -1, -1, -1), masks.unsqueeze(2), others.unsqueeze(2)], 2)
        g = self.value_encoder(x.flatten(0, 1))
        g = self.value_fuser(torch.cat([g, f16.unsqueeze(1).expand(-1, K, -1, -1, -1).flatten(0, 1)], 1))
        h = self.value_hidden(g, hidden.flatten(0, 1))
        return g.view(B, K, *g.shape[1:]), h.view(B, K, *h.shape[1:])

    def read_memory(self, mk, ms, mv, qk, qe):
        a_sq = mk.pow(2).transpose(1, 2) @ qe
        two_ab = 2 * (mk.transpose(1, 2) @ (qk * qe))
        b_sq = (qe * qk.pow(2)).sum(1, keepdim=True)
        aff = F.softmax((-a_sq + two_ab - b_sq) * ms.transpose(1, 2) / math.sqrt(mk.shape[1]), dim=1)
        B, K, C, _ = mv.shape
        return (mv.flatten(1, 2) @ aff).view(B, K, C, *qk.shape[-1:])

    def segment(self, f16, readout, hidden, out_size):
        B, K = readout.shape[:2]
        x = torch.cat([f16.unsqueeze(1).expand(-1, K, -1, -1, -1), readout, hidden], 2).flatten(0, 1)
        x = self.decoder_fuser(x)
        hidden = self.decoder_hidden(x, hidden.flatten(0, 1)).view(B, K, self.hidden_dim, *x.shape[-2:])
        logits = F.interpolate(self.pred(x), size=out_size, mode="bilinear", align_corners=False)
        return logits.view(B, K, *out_size), hidden

    def forward(self, frames, masks, selector):
        B, T, _, H, W = frames.shape
        K = masks.shape[2]
        f16, key, shrink, sel = (x.view(B, T, *x.shape[1:]) for x in self.encode_key(frames.flatten(0, 1)))
        h, w = f16.shape[-2:]
        hidden = torch.zeros(B, K, self.hidden_dim, h, w, device=frames.device)
        sm = selector[:, :, None, None]
        v, hidden = self.encode_value(frames[:, 0], f16[:, 0], hidden, masks[:, 0] * sm)
        mk, ms, mv, out = [key[:, 0]], [shrink[:, 0]], [v], []
        for t in range(1, T):
            readout = self.read_memory(torch.stack(mk, 2).flatten(2), torch.stack(ms, 2).flatten(2),
                                       torch.stack(mv, 3).flatten(3), key[:, t].flatten(2), sel[:, t].flatten(2))
            logits, hidden = self.segment(f16[:, t], readout.view(B, K, -1, h, w), hidden, (H, W))
            out.append(logits)
            if t < T - 1:
                prob = torch.sigmoid(logits) * sm
                v, hidden = self.encode_value(frames[:, t], f16[:, t], hidden, prob)
                mk.append(key[:, t])
                ms.append(shrink[:, t])
                mv.append(v)
        return torch.stack(out, 1)


def loss_fn(logits, gt, selector):
    sm = selector[:, None, :, None, None]
    bce = (F.binary_cross_entropy_with_logits(logits, gt, reduction="none") * sm).sum()
    bce = bce / (sm.sum() * logits.shape[1] * logits.shape[-1] * logits.shape[-2]).clamp(min=1)
    p, g = torch.sigmoid(logits).flatten(-2), gt.flatten(-2)
    dice = 1 - (2 * (p * g).sum(-1) + 1) / (p.sum(-1) + g.sum(-1) + 1)
    dice = (dice * selector[:, None]).sum() / (selector.sum() * logits.shape[1]).clamp(min=1)
    return bce + dice


def boundary_f(pred, gt, tol=3):
    def edge(m):
        m = m.float()[:, None]
        return (m + F.max_pool2d(-m, 3, 1, 1))[:, 0] > 0

    def dilate(m):
        return F.max_pool2d(m.float()[:, None], 2 * tol + 1, 1, tol)[:, 0] > 0

    pe, ge = edge(pred), edge(gt)
    prec = (pe & dilate(ge)).flatten(1).sum(1) / pe.flatten(1).sum(1).clamp(min=1)
    rec = (ge & dilate(pe)).flatten(1).sum(1) / ge.flatten(1).sum(1).clamp(min=1)
    f = 2 * prec * rec / (prec + rec).clamp(min=1e-8)
    empty = (pe.flatten(1).sum(1) == 0) & (ge.flatten(1).sum(1) == 0)
    return torch.where(empty, torch.ones_like(f), f).mean()


@torch.no_grad()
def evaluate(net, cfg, device, rank, world):
    root = cfg.data.davis
    videos = open(os.path.join(root, "ImageSets/2017/val.txt")).read().split()
    js, fs = [], []
    net.eval()
    for vid in videos[rank::world]:
        names = sorted(os.listdir(os.path.join(root, "JPEGImages/480p", vid)))
        frames = torch.stack([(torch.from_numpy(np.asarray(Image.open(os.path.join(root, "JPEGImages/480p", vid, n)).convert("RGB"),
                                                           dtype=np.float32)).permute(2, 0, 1) / 255 - MEAN) / STD
                              for n in names]).to(device)
        gts = torch.stack([torch.from_numpy(np.asarray(Image.open(os.path.join(root, "Annotations/480p", vid, n[:-4] + ".png")),
                                                       dtype=np.int64)) for n in names]).to(device)
        H, W = gts.shape[-2:]
        frames = F.pad(frames, (0, (-W) % 16, 0, (-H) % 16), mode="replicate")
        K = int(gts[0].max())
        prob = F.pad(torch.stack([(gts[0] == k + 1).float() for k in range(K)]), (0, (-W) % 16, 0, (-H) % 16))[None]
        f16, key, shrink, sel = net.encode_key(frames[:1])
        hidden = torch.zeros(1, K, net.hidden_dim, *f16.shape[-2:], device=device)
        v, hidden = net.encode_value(frames[:1], f16, hidden, prob)
        mem, preds = [(key, shrink, v)], [gts[0]]
        for t in range(1, len(names)):
            f16, key, shrink, sel = net.encode_key(frames[t:t + 1])
            readout = net.read_memory(torch.stack([m[0] for m in mem], 2).flatten(2), torch.stack([m[1] for m in mem], 2).flatten(2),
                                      torch.stack([m[2] for m in mem], 3).flatten(3), key.flatten(2), sel.flatten(2))
            logits, hidden = net.segment(f16, readout.view(1, K, -1, *f16.shape[-2:]), hidden, frames.shape[-2:])
            prob = torch.sigmoid(logits)
            preds.append(torch.where(prob.max(1).values > 0.5, prob.argmax(1) + 1, 0)[0, :H, :W])
            if t % cfg.eval.mem_every == 0:
                v, hidden = net.encode_value(frames[t:t + 1], f16, hidden, prob)
                mem = mem[:1] + mem[1:][-(cfg.eval.max_mem - 2):] + [(key, shrink, v)]
        pred = torch.stack(preds)
        for k in range(1, K + 1):
            p, g = pred[1:-1] == k, gts[1:-1] == k
            u = (p | g).flatten(1).sum(1).float()
            js.append(torch.where(u > 0, (p & g).flatten(1).sum(1) / u.clamp(min=1), torch.ones_like(u)).mean().item())
            fs.append(boundary_f(p, g).item())
    net.train()
    j, f = float(np.mean(js)), float(np.mean(fs))
    return j, f, (j + f) / 2


def main():
    cfg = OmegaConf.merge(BASE, OmegaConf.from_cli(sys.argv[1:]))
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(7)
    random.seed(7 + rank)
    use_wandb = cfg.wandb.enabled and rank == 0
    if rank == 0:
        os.makedirs(cfg.train.out, exist_ok=True)
        OmegaConf.save(cfg, os.path.join(cfg.train.out, "config.yaml"))
    if use_wandb:
        wandb.init(project=cfg.wandb.project, config=OmegaConf.to_container(cfg))

    net = XMem(cfg.model.hidden_dim).to(device)
    if cfg.train.init:
        missing, unexpected = net.load_state_dict(torch.load(cfg.train.init, map_location="cpu"), strict=False)
        if rank == 0:
            print(f"init: {len(missing)} missing, {len(unexpected)} unexpected keys")
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    iters = cfg.train.iterations
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / cfg.train.warmup) * 0.5 * (1 + math.cos(math.pi * i / iters)))

    data = MOSEClips(cfg.data.mose, cfg.data)
    sampler = DistributedSampler(data, shuffle=True, drop_last=True)
    loader = DataLoader(data, cfg.train.batch_size, sampler=sampler, num_workers=cfg.data.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    it, epoch, best = 0, 0, -1.0
    tic = time.time()
    while it < iters:
        sampler.set_epoch(epoch)
        for frames, masks, selector in loader:
            frames, masks, selector = frames.to(device), masks.to(device), selector.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(frames, masks, selector)
            loss = loss_fn(logits.float(), masks[:, 1:], selector)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 3.0)
            opt.step()
            sched.step()
            it += 1
            if use_wandb and it % 100 == 0:
                wandb.log({"train/loss": loss.item(), "train/lr": sched.get_last_lr()[0],
                           "train/sec_per_it": (time.time() - tic) / 100}, step=it)
                tic = time.time()
            if it % cfg.train.eval_every == 0 or it == iters:
                j, f, jf = evaluate(net, cfg, device, rank, world)
                if rank == 0:
                    if use_wandb:
                        wandb.log({"val/J": j, "val/F": f, "val/J&F": jf}, step=it)
                    print(f"[{it}] DAVIS-17 val J {j:.4f} F {f:.4f} J&F {jf:.4f}", flush=True)
                    torch.save({"image_encoder": net.key_encoder.state_dict(),
                                "memory": {k: v for k, v in net.state_dict().items() if not k.startswith("key_encoder.")},
                                "optimizer": opt.state_dict(), "it": it}, os.path.join(cfg.train.out, "last.pth"))
                    if jf > best:
                        best = jf
                        torch.save(net.state_dict(), os.path.join(cfg.train.out, "best.pth"))
            if it >= iters:
                break
        epoch += 1

    if use_wandb:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
