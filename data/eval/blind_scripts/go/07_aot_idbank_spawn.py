"""AOT-style identity-bank tracker, multi-object propagation, single node / multi GPU via mp.spawn.

    python 07_aot_idbank_spawn.py --gpus 8 --data /data/ytvos/train --davis /data/DAVIS/2017/trainval
"""
import argparse
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchvision.models import ResNet50_Weights, resnet50
from torchvision.ops import FrozenBatchNorm2d

MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--port", type=int, default=29533)
    p.add_argument("--data", default="/data/ytvos/train")
    p.add_argument("--davis", default="/data/DAVIS/2017/trainval")
    p.add_argument("--out", default="result/aot_r50")
    p.add_argument("--max-obj", type=int, default=10)
    p.add_argument("--seq-len", type=int, default=5)
    p.add_argument("--size", type=int, default=465)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--lstt-layers", type=int, default=3)
    p.add_argument("--mem-every", type=int, default=5)
    p.add_argument("--workers", type=int, default=6)
    return p.parse_args()


def to_tensor(img):
    return torch.from_numpy(((np.asarray(img, dtype=np.float32) / 255.0 - MEAN) / STD).transpose(2, 0, 1).copy())


class YTVOSSeq(Dataset):
    def __init__(self, root, seq_len, max_obj, size):
        self.root, self.seq_len, self.max_obj, self.size = root, seq_len, max_obj, size
        self.videos = sorted(v for v in os.listdir(os.path.join(root, "JPEGImages"))
                             if len(os.listdir(os.path.join(root, "JPEGImages", v))) >= seq_len)

    def __len__(self):
        return len(self.videos)

    def __getitem__(self, i):
        vid = self.videos[i]
        names = sorted(n[:-4] for n in os.listdir(os.path.join(self.root, "JPEGImages", vid)))
        start = random.randint(0, len(names) - self.seq_len)
        picks = sorted(random.sample(range(start, min(len(names), start + 3 * self.seq_len)), self.seq_len))
        S = self.size
        imgs = [Image.open(os.path.join(self.root, "JPEGImages", vid, names[j] + ".jpg")).convert("RGB") for j in picks]
        anns = [Image.open(os.path.join(self.root, "Annotations", vid, names[j] + ".png")) for j in picks]
        w, h = imgs[0].size
        sc = S / min(w, h) * random.uniform(1.0, 1.3)
        nw, nh = max(S, int(w * sc)), max(S, int(h * sc))
        x0, y0 = random.randint(0, nw - S), random.randint(0, nh - S)
        box = (x0, y0, x0 + S, y0 + S)
        rgb = torch.stack([to_tensor(im.resize((nw, nh), Image.BILINEAR).crop(box)) for im in imgs])
        lab = np.stack([np.asarray(a.resize((nw, nh), Image.NEAREST).crop(box)) for a in anns]).astype(np.int64)
        ids = [o for o in np.unique(lab[0]) if o not in (0, 255)]
        random.shuffle(ids)
        ids = ids[: self.max_obj]
        relabeled = np.zeros_like(lab)
        for new, old in enumerate(ids, start=1):
            relabeled[lab == old] = new
        return rgb, torch.from_numpy(relabeled), len(ids)


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        r = resnet50(weights=ResNet50_Weights.IMAGENET1K_V2, norm_layer=FrozenBatchNorm2d)
        self.stem = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool)
        self.layer1, self.layer2, self.layer3 = r.layer1, r.layer2, r.layer3

    def forward(self, x):
        f4 = self.layer1(self.stem(x))
        f8 = self.layer2(f4)
        return self.layer3(f8), f8, f4


class LSTTLayer(nn.Module):
    def __init__(self, d, heads=8):
        super().__init__()
        self.n1, self.n2, self.n3, self.n4 = (nn.LayerNorm(d) for _ in range(4))
        self.self_attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.long_attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.short_attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ffn = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, pos, long_k, long_v, short_k, short_v):
        q = self.n1(x) + pos
        x = x + self.self_attn(q, q, self.n1(x), need_weights=False)[0]
        q = self.n2(x) + pos
        x = x + self.long_attn(q, long_k, long_v, need_weights=False)[0]
        x = x + self.short_attn(self.n3(x) + pos, short_k, short_v, need_weights=False)[0]
        return x + self.ffn(self.n4(x))


class AOT(nn.Module):
    def __init__(self, max_obj, layers, d=256):
        super().__init__()
        self.max_obj, self.d = max_obj, d
        self.encoder = Encoder()
        self.proj = nn.Conv2d(1024, d, 1)
        self.id_bank = nn.Conv2d(max_obj + 1, d, 17, 16, 8)
        self.pos = nn.Parameter(torch.zeros(1, d, 64, 64))
        self.lstt = nn.ModuleList([LSTTLayer(d) for _ in range(layers)])
        self.dec16 = nn.Sequential(nn.Conv2d(d, 256, 3, padding=1), nn.BatchNorm2d(256), nn.ReLU(inplace=True))
        self.lat8, self.lat4 = nn.Conv2d(512, 256, 1), nn.Conv2d(256, 128, 1)
        self.dec8 = nn.Sequential(nn.Conv2d(256, 128, 3, padding=1), nn.BatchNorm2d(128), nn.ReLU(inplace=True))
        self.dec4 = nn.Sequential(nn.Conv2d(128, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(inplace=True))
        self.cls = nn.Conv2d(64, max_obj + 1, 1)
        nn.init.trunc_normal_(self.pos, std=0.02)

    def embed(self, frames):
        f16, f8, f4 = self.encoder(frames)
        return self.proj(f16), f8, f4

    def id_embed(self, x16, prob):
        return x16 + self.id_bank(prob)

    def tokens(self, x):
        return x.flatten(2).transpose(1, 2)

    def propagate(self, x16, f8, f4, long_k, long_v, short_k, short_v, size):
        n, d, h, w = x16.shape
        pos = self.tokens(F.interpolate(self.pos, size=(h, w), mode="bilinear", align_corners=False))
        x = self.tokens(x16)
        for layer in self.lstt:
            x = layer(x, pos, long_k, long_v, short_k, short_v)
        x = self.dec16(x.transpose(1, 2).reshape(n, d, h, w))
        x = self.dec8(self.lat8(f8) + F.interpolate(x, size=f8.shape[-2:], mode="bilinear", align_corners=False))
        x = self.dec4(self.lat4(f4) + F.interpolate(x, size=f4.shape[-2:], mode="bilinear", align_corners=False))
        return F.interpolate(self.cls(x), size=size, mode="bilinear", align_corners=False)

    def forward(self, rgb, labels, num_obj):
        B, T, _, H, W = rgb.shape
        x16, f8, f4 = (x.view(B, T, *x.shape[1:]) for x in self.embed(rgb.flatten(0, 1)))
        ids = torch.arange(self.max_obj + 1, device=rgb.device)
        valid_cls = ids[None] <= num_obj[:, None]
        ref = F.one_hot(labels[:, 0].clamp(max=self.max_obj), self.max_obj + 1).permute(0, 3, 1, 2).float()
        long_k, long_v = self.tokens(x16[:, 0]), self.tokens(self.id_embed(x16[:, 0], ref))
        short_k, short_v = long_k, long_v
        outs = []
        for t in range(1, T):
            logits = self.propagate(x16[:, t], f8[:, t], f4[:, t], long_k, long_v, short_k, short_v, (H, W))
            logits = logits.masked_fill(~valid_cls[:, :, None, None], -1e4)
            outs.append(logits)
            short_k, short_v = self.tokens(x16[:, t]), self.tokens(self.id_embed(x16[:, t], logits.softmax(1)))
        return torch.stack(outs, 1)


def aot_loss(logits, labels, num_obj):
    B, T1, C, H, W = logits.shape
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1), ignore_index=255)
    prob = logits.softmax(2)
    onehot = F.one_hot(labels.clamp(max=C - 1), C).permute(0, 1, 4, 2, 3).float()
    inter = (prob * onehot).flatten(3).sum(-1)
    union = (prob + onehot - prob * onehot).flatten(3).sum(-1)
    jac = 1 - (inter + 1) / (union + 1)
    obj_mask = (torch.arange(1, C, device=logits.device)[None] <= num_obj[:, None]).float()[:, None]
    jac = (jac[:, :, 1:] * obj_mask).sum() / (obj_mask.sum() * T1).clamp(min=1)
    return ce + jac


@torch.no_grad()
def evaluate(net, args, rank, world):
    vids = open(os.path.join(args.davis, "ImageSets/2017/val.txt")).read().split()
    results = {}
    net.eval()
    for vid in vids[rank::world]:
        names = sorted(n[:-4] for n in os.listdir(os.path.join(args.davis, "JPEGImages/480p", vid)))
        gts = np.stack([np.asarray(Image.open(os.path.join(args.davis, "Annotations/480p", vid, n + ".png"))) for n in names])
        n_obj = int(gts[0].max())
        H, W = gts.shape[1:]
        long_k, long_v, short = [], [], None
        preds = [gts[0]]
        for t, n in enumerate(names):
            img = to_tensor(Image.open(os.path.join(args.davis, "JPEGImages/480p", vid, n + ".jpg")).convert("RGB"))
            img = F.pad(img[None].cuda(), (0, (-W) % 16, 0, (-H) % 16))
            x16, f8, f4 = net.embed(img)
            if t == 0:
                prob = F.one_hot(torch.from_numpy(gts[0]).long().cuda(), net.max_obj + 1).permute(2, 0, 1)[None].float()
                prob = F.pad(prob, (0, (-W) % 16, 0, (-H) % 16))
            else:
                logits = net.propagate(x16, f8, f4, torch.cat(long_k, 1), torch.cat(long_v, 1), *short, img.shape[-2:])
                logits[:, n_obj + 1:] = -1e4
                prob = logits.softmax(1)
                preds.append(prob[0, :, :H, :W].argmax(0).cpu().numpy())
            kv = (net.tokens(x16), net.tokens(net.id_embed(x16, prob)))
            short = kv
            if t % args.mem_every == 0:
                long_k.append(kv[0])
                long_v.append(kv[1])
        pred = np.stack(preds)
        scores = []
        for k in range(1, n_obj + 1):
            p, g = pred[1:-1] == k, gts[1:-1] == k
            u = (p | g).sum((1, 2))
            scores.append(float(np.mean(np.where(u > 0, (p & g).sum((1, 2)) / np.maximum(u, 1), 1.0))))
        results[vid] = scores
    net.train()
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    merged = {k: v for part in gathered for k, v in part.items()}
    return float(np.mean([s for v in merged.values() for s in v]))


def worker(rank, world_size, args):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    random.seed(rank)
    np.random.seed(rank)
    torch.manual_seed(0)

    net = AOT(args.max_obj, args.lstt_layers)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).cuda()
    model = DDP(net, device_ids=[rank])
    enc_params = list(model.module.encoder.parameters())
    enc_ids = set(map(id, enc_params))
    opt = torch.optim.AdamW([{"params": enc_params, "lr": args.lr * 0.1},
                             {"params": [p for p in model.parameters() if id(p) not in enc_ids]}],
                            lr=args.lr, weight_decay=0.07)
    ds = YTVOSSeq(args.data, args.seq_len, args.max_obj, args.size)
    sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True)
    total = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 1000) * (1 - s / total) ** 0.9)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(ds)} videos, {len(loader)} it/epoch on {world_size} GPUs", flush=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        tic = time.time()
        for it, (rgb, labels, num_obj) in enumerate(loader):
            rgb, labels, num_obj = rgb.cuda(non_blocking=True), labels.cuda(non_blocking=True), num_obj.cuda()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(rgb, labels, num_obj)
            loss = aot_loss(logits.float(), labels[:, 1:], num_obj)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            if rank == 0 and it % 50 == 0:
                print(f"ep {epoch} it {it} loss {loss.item():.4f} lr {sched.get_last_lr()[-1]:.2e} "
                      f"{(time.time() - tic) / (it + 1):.2f}s/it", flush=True)

        j = evaluate(model.module, args, rank, world_size)
        if rank == 0:
            print(f"epoch {epoch}: DAVIS-17 val J = {j:.4f}", flush=True)
            torch.save({"encoder": model.module.encoder.state_dict(),
                        "memory": {k: v for k, v in model.module.state_dict().items() if not k.startswith("encoder.")},
                        "optimizer": opt.state_dict(), "epoch": epoch, "J": j},
                       os.path.join(args.out, f"ep{epoch:02d}.pth"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse_args()
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)
