"""BIT-style (bitemporal image transformer) change detection, 4-band PlanetScope / SkySat pairs.

ResNet-18 stem -> semantic tokens per date -> transformer encoder over the
concatenated tokens -> transformer decoder back to pixel space for each date
-> |f1 - f2| -> classifier.  The pixel-space decoder runs on 4096 queries per
image, so it is checkpointed to fit 256 px crops at batch 16 per GPU.

    torchrun --nproc_per_node=8 08_bit_transformer_cd.py --cfg cfg/bit_r18.yaml
"""
import argparse
import math
import os
import time

import numpy as np
import tifffile
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


class PairChips(Dataset):
    def __init__(self, list_file, root, mean, std, train):
        with open(list_file) as f:
            self.ids = [l.strip() for l in f if l.strip()]
        self.root, self.train = root, train
        self.mean = np.array(mean, np.float32)[:, None, None]
        self.std = np.array(std, np.float32)[:, None, None]

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        cid = self.ids[i]
        a = tifffile.imread(os.path.join(self.root, "A", cid + ".tif")).astype(np.float32).transpose(2, 0, 1)
        b = tifffile.imread(os.path.join(self.root, "B", cid + ".tif")).astype(np.float32).transpose(2, 0, 1)
        y = (tifffile.imread(os.path.join(self.root, "label", cid + ".tif")) > 0).astype(np.int64)
        a, b = (a - self.mean) / self.std, (b - self.mean) / self.std
        if self.train:
            if np.random.rand() < 0.5:
                a, b, y = a[..., ::-1], b[..., ::-1], y[..., ::-1]
            if np.random.rand() < 0.5:
                a, b, y = a[:, ::-1], b[:, ::-1], y[::-1]
        c = lambda v: torch.from_numpy(np.ascontiguousarray(v))
        return c(a), c(b), c(y)


class BIT(nn.Module):
    def __init__(self, in_ch=4, dim=32, n_tokens=4, enc_depth=1, dec_depth=8, heads=8,
                 use_checkpoint=True, backbone_ckpt=None):
        super().__init__()
        r18 = torchvision.models.resnet18()
        if backbone_ckpt:
            r18.load_state_dict(torch.load(backbone_ckpt, map_location="cpu"))
        w = r18.conv1.weight.data
        r18.conv1 = nn.Conv2d(in_ch, 64, 7, 2, 3, bias=False)
        r18.conv1.weight.data[:, :3] = w
        r18.conv1.weight.data[:, 3:] = w.mean(1, keepdim=True)
        self.backbone = nn.Sequential(r18.conv1, r18.bn1, r18.relu, r18.maxpool, r18.layer1, r18.layer2)
        self.proj = nn.Conv2d(128, dim, 3, padding=1)
        self.token_attn = nn.Conv2d(dim, n_tokens, 1)
        self.pos_tokens = nn.Parameter(torch.randn(1, 2 * n_tokens, dim) * 0.02)
        self.pos_pix = nn.Parameter(torch.randn(1, dim, 32, 32) * 0.02)
        enc_layer = nn.TransformerEncoderLayer(dim, heads, dim * 2, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(enc_layer, enc_depth)
        dec_layer = nn.TransformerDecoderLayer(dim, heads, dim * 2, dropout=0.0, batch_first=True, norm_first=True)
        self.decoder = nn.TransformerDecoder(dec_layer, dec_depth)
        self.classifier = nn.Sequential(nn.Conv2d(dim, dim, 3, padding=1), nn.BatchNorm2d(dim),
                                        nn.ReLU(inplace=True), nn.Conv2d(dim, 2, 3, padding=1))
        self.n_tokens, self.use_checkpoint = n_tokens, use_checkpoint

    def features(self, x):
        return self.proj(self.backbone(x))

    def tokens(self, f):
        att = self.token_attn(f).flatten(2).softmax(-1)          # B, L, HW
        return torch.einsum("bln,bcn->blc", att, f.flatten(2))   # B, L, C

    def decode(self, f, tok):
        b, c, h, w = f.shape
        q = (f + F.interpolate(self.pos_pix, size=(h, w), mode="bilinear", align_corners=False))
        q = q.flatten(2).transpose(1, 2)
        if self.use_checkpoint and self.training:
            out = checkpoint(self.decoder, q, tok)
        else:
            out = self.decoder(q, tok)
        return out.transpose(1, 2).reshape(b, c, h, w)

    def forward(self, x1, x2):
        f1, f2 = self.features(x1), self.features(x2)
        t = torch.cat([self.tokens(f1), self.tokens(f2)], 1) + self.pos_tokens
        t = self.encoder(t)
        t1, t2 = t[:, : self.n_tokens], t[:, self.n_tokens:]
        d = torch.abs(self.decode(f1, t1) - self.decode(f2, t2))
        d = F.interpolate(d, size=x1.shape[-2:], mode="bilinear", align_corners=False)
        return self.classifier(d)


def warmup_cosine(step, warmup, total):
    if step < warmup:
        return step / max(1, warmup)
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


@torch.no_grad()
def run_eval(net, loader, dev):
    net.eval()
    s = torch.zeros(3, dtype=torch.float64, device=dev)
    for a, b, y in loader:
        a, b, y = a.to(dev), b.to(dev), y.to(dev)
        p = net(a, b).argmax(1).bool()
        t = y.bool()
        s += torch.stack([(p & t).sum(), (p & ~t).sum(), (~p & t).sum()]).double()
    dist.all_reduce(s)
    tp, fp, fn = s.tolist()
    return 2 * tp / max(1.0, 2 * tp + fp + fn), tp / max(1.0, tp + fp + fn)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    with open(args.cfg) as f:
        cfg = yaml.safe_load(f)
    out_dir = args.out or cfg["out_dir"]

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.get("seed", 0))

    tr = PairChips(cfg["train_list"], cfg["root"], cfg["mean"], cfg["std"], train=True)
    va = PairChips(cfg["val_list"], cfg["root"], cfg["mean"], cfg["std"], train=False)
    sampler = DistributedSampler(tr, shuffle=True)
    tl = DataLoader(tr, cfg["batch_size"], sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)
    vl = DataLoader(Subset(va, range(rank, len(va), world)), cfg["batch_size"], num_workers=8, pin_memory=True)

    net = BIT(in_ch=len(cfg["mean"]), use_checkpoint=cfg.get("checkpoint", True),
              backbone_ckpt=cfg.get("backbone_ckpt"))
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(dev)
    model = DDP(net, device_ids=[local_rank])

    base_lr = cfg["lr"] * cfg["batch_size"] * world / 128
    opt = torch.optim.AdamW(model.parameters(), lr=base_lr, weight_decay=cfg.get("wd", 0.01))
    total = cfg["epochs"] * len(tl)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warmup_cosine(s, 500, total))

    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        print(f"{len(tr)} train / {len(va)} val chips, global batch {cfg['batch_size'] * world}, lr {base_lr:.2e}")
    best = 0.0
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (a, b, y) in enumerate(tl):
            a, b, y = a.to(dev, non_blocking=True), b.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(a, b)
            loss = F.cross_entropy(logits.float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and it % 100 == 0:
                print(f"ep {epoch} it {it}/{len(tl)} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e}", flush=True)
        f1, iou = run_eval(net, vl, dev)
        if rank == 0:
            print(f"== epoch {epoch} val F1 {f1:.4f} IoU {iou:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if f1 > best:
                best = f1
                torch.save({"state_dict": net.state_dict(), "epoch": epoch, "f1": f1, "cfg": cfg},
                           os.path.join(out_dir, "best_ckpt.pt"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
