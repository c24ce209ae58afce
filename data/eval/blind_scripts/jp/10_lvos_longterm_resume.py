"""
Long-video VOS training (LVOS / YouTube-VOS) with a working memory + compressed long-term memory.
Jobs are preemptible, so the trainer resumes from <out>/latest.pth automatically.

    torchrun --nproc_per_node=8 train_lvos.py --lvos /data/LVOS/train --ytvos /data/YTVOS/train \
        --davis /data/DAVIS --out /checkpoints/lvos_ltm
"""
import argparse
import glob
import json
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from timm.layers import freeze_batch_norm_2d
from torch.utils.tensorboard import SummaryWriter


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lvos", required=True)
    ap.add_argument("--ytvos", required=True)
    ap.add_argument("--davis", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--frames", type=int, default=10)
    ap.add_argument("--size", type=int, default=432)
    ap.add_argument("--batch", type=int, default=2, help="per GPU")
    ap.add_argument("--lr", type=float, default=3e-5, help="tuned for 8 GPUs x batch 2")
    ap.add_argument("--steps", type=int, default=120000)
    ap.add_argument("--ltm_every", type=int, default=4, help="compress working memory into long-term every N frames")
    ap.add_argument("--val_every", type=int, default=5000)
    ap.add_argument("--save_every", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


def rgb(path, size):
    a = np.asarray(Image.open(path).convert("RGB").resize((size, size), Image.BILINEAR), np.float32) / 255.0
    return torch.from_numpy(((a - (0.485, 0.456, 0.406)) / (0.229, 0.224, 0.225)).astype(np.float32)).permute(2, 0, 1)


class LongClipDataset(Dataset):
    def __init__(self, root, frames, size, meta_name=None):
        self.root, self.frames, self.size = root, frames, size
        self.vids = []
        for v in sorted(os.listdir(os.path.join(root, "Annotations"))):
            anns = sorted(os.listdir(os.path.join(root, "Annotations", v)))
            if len(anns) >= frames:
                self.vids.append((v, [a[:-4] for a in anns]))

    def __len__(self):
        return len(self.vids)

    def __getitem__(self, i):
        v, names = self.vids[i]
        # long gaps so the model has to re-detect objects that drift or reappear
        span = min(len(names), self.frames * random.choice([1, 3, 6]))
        s = random.randint(0, len(names) - span)
        pick = sorted(random.sample(range(s + 1, s + span), self.frames - 1))
        ids = [s] + pick
        imgs = torch.stack([rgb(os.path.join(self.root, "JPEGImages", v, names[k] + ".jpg"), self.size) for k in ids])
        ann = np.stack([np.asarray(Image.open(os.path.join(self.root, "Annotations", v, names[k] + ".png")).resize((self.size, self.size), Image.NEAREST)) for k in ids])
        objs = [o for o in np.unique(ann[0]) if o != 0]
        o = random.choice(objs) if objs else -1
        return imgs, torch.from_numpy((ann == o).astype(np.float32))


class LTMNet(nn.Module):
    def __init__(self, dim=256, key_dim=64, ltm_tokens=128):
        super().__init__()
        self.backbone = freeze_batch_norm_2d(
            timm.create_model("resnet50.a1_in1k", pretrained=True, features_only=True, out_indices=(1, 2, 3)))
        self.key = nn.Conv2d(1024, key_dim, 1)
        self.value = nn.Sequential(nn.Conv2d(1024 + 1, dim, 3, padding=1), nn.GroupNorm(32, dim), nn.ReLU(), nn.Conv2d(dim, dim, 3, padding=1))
        self.ltm_queries = nn.Parameter(torch.randn(ltm_tokens, key_dim + dim) * 0.02)
        self.compress = nn.MultiheadAttention(key_dim + dim, 8, batch_first=True)
        self.dec16 = nn.Sequential(nn.Conv2d(1024 + 2 * dim, 256, 3, padding=1), nn.GroupNorm(32, 256), nn.ReLU())
        self.dec8 = nn.Sequential(nn.Conv2d(256 + 512, 128, 3, padding=1), nn.GroupNorm(16, 128), nn.ReLU())
        self.dec4 = nn.Sequential(nn.Conv2d(128 + 256, 64, 3, padding=1), nn.GroupNorm(8, 64), nn.ReLU(), nn.Conv2d(64, 1, 1))
        self.key_dim = key_dim

    def feats(self, x):
        f4, f8, f16 = self.backbone(x)
        return self.key(f16), f16, f8, f4

    def make_value(self, f16, mask):
        m = F.interpolate(mask[:, None], size=f16.shape[-2:], mode="bilinear", align_corners=False)
        return self.value(torch.cat([f16, m], 1))

    def compress_memory(self, keys, values):
        # keys: B Ck N, values: B Cv N -> fixed-size long-term tokens
        tok = torch.cat([keys, values], 1).transpose(1, 2)
        q = self.ltm_queries[None].expand(tok.shape[0], -1, -1)
        out = self.compress(q, tok, tok, need_weights=False)[0].transpose(1, 2)
        return out[:, : self.key_dim], out[:, self.key_dim:]

    @staticmethod
    def read(qk, mk, mv):
        b, c, h, w = qk.shape
        aff = (2 * mk.transpose(1, 2) @ qk.flatten(2) - mk.pow(2).sum(1)[..., None]) / c ** 0.5
        return (mv @ aff.softmax(1)).view(b, -1, h, w)

    def decode(self, f16, f8, f4, wm_read, ltm_read, size):
        x = self.dec16(torch.cat([f16, wm_read, ltm_read], 1))
        x = self.dec8(torch.cat([F.interpolate(x, size=f8.shape[-2:], mode="bilinear", align_corners=False), f8], 1))
        x = self.dec4(torch.cat([F.interpolate(x, size=f4.shape[-2:], mode="bilinear", align_corners=False), f4], 1))
        return F.interpolate(x, size=size, mode="bilinear", align_corners=False)[:, 0]

    def run(self, k, f16, f8, f4, mask0, size, ltm_every, mem_every=1, gt=None):
        T = k.shape[1]
        wk, wv = [k[:, 0].flatten(2)], [self.make_value(f16[:, 0], mask0).flatten(2)]
        lk, lv = self.compress_memory(wk[0], wv[0])
        outs = []
        for t in range(1, T):
            lg = self.decode(f16[:, t], f8[:, t], f4[:, t], self.read(k[:, t], torch.cat(wk, 2), torch.cat(wv, 2)),
                             self.read(k[:, t], lk, lv), size)
            outs.append(lg)
            if t % mem_every == 0:
                wk.append(k[:, t].flatten(2))
                wv.append(self.make_value(f16[:, t], torch.sigmoid(lg)).flatten(2))
            if len(wk) > ltm_every:
                ck, cv = self.compress_memory(torch.cat([lk] + wk[1:], 2), torch.cat([lv] + wv[1:], 2))
                lk, lv = ck, cv
                wk, wv = wk[:1], wv[:1]
        return torch.stack(outs, 1)

    def forward(self, clip, mask0, ltm_every):
        B, T = clip.shape[:2]
        k, f16, f8, f4 = [x.unflatten(0, (B, T)) for x in self.feats(clip.flatten(0, 1))]
        return self.run(k, f16, f8, f4, mask0, clip.shape[-2:], ltm_every)


def seq_scores(pred, gt):
    u = (pred | gt).sum((1, 2))
    j = np.where(u == 0, 1.0, (pred & gt).sum((1, 2)) / np.maximum(u, 1))
    t = torch.from_numpy(np.concatenate([pred, gt]).astype(np.float32))[:, None]
    e = (t + F.max_pool2d(-t, 3, 1, 1)) > 0
    d = F.max_pool2d(e.float(), 9, 1, 4) > 0
    n = pred.shape[0]
    pe, ge, pd, gd = e[:n], e[n:], d[:n], d[n:]
    prec = (pe & gd).flatten(1).sum(1).float() / pe.flatten(1).sum(1).clamp(min=1)
    rec = (ge & pd).flatten(1).sum(1).float() / ge.flatten(1).sum(1).clamp(min=1)
    f = torch.where(prec + rec > 0, 2 * prec * rec / (prec + rec).clamp(min=1e-8), torch.zeros_like(prec))
    f = torch.where(pe.flatten(1).sum(1) + ge.flatten(1).sum(1) == 0, torch.ones_like(f), f)
    return float(j.mean()), float(f.mean())


@torch.no_grad()
def evaluate(net, davis, size, ltm_every, device):
    rank, world = dist.get_rank(), dist.get_world_size()
    seqs = open(os.path.join(davis, "ImageSets/2017/val.txt")).read().split()
    acc = torch.zeros(3, device=device, dtype=torch.float64)
    for seq in seqs[rank::world]:
        names = sorted(os.listdir(os.path.join(davis, "JPEGImages/480p", seq)))
        clip = torch.stack([rgb(os.path.join(davis, "JPEGImages/480p", seq, n), size) for n in names]).to(device)
        gts = np.stack([np.asarray(Image.open(os.path.join(davis, "Annotations/480p", seq, n[:-4] + ".png")).resize((size, size), Image.NEAREST)) for n in names])
        k, f16, f8, f4 = [x[None] for x in net.feats(clip)]
        js, fs = [], []
        for o in [o for o in np.unique(gts[0]) if o != 0]:
            m0 = torch.from_numpy((gts[0] == o).astype(np.float32)).to(device)[None]
            logits = net.run(k, f16, f8, f4, m0, (size, size), ltm_every, mem_every=5)[0]
            j, f = seq_scores((logits > 0).cpu().numpy(), gts[1:] == o)
            js.append(j)
            fs.append(f)
        acc += torch.tensor([np.mean(js), np.mean(fs), 1.0], device=device, dtype=torch.float64)
    dist.all_reduce(acc)
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


class Trainer:
    def __init__(self, args):
        self.args = args
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        random.seed(1234 + self.rank)
        np.random.seed(1234 + self.rank)
        self.net = LTMNet().to(self.device)
        self.model = DDP(self.net, device_ids=[self.local_rank])
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.lr, weight_decay=0.05)
        self.sched = torch.optim.lr_scheduler.MultiStepLR(self.opt, [int(args.steps * 0.8)], 0.1)
        self.step = 0
        self.writer = SummaryWriter(os.path.join(args.out, "tb")) if self.rank == 0 else None
        self.maybe_resume()

    def maybe_resume(self):
        path = os.path.join(self.args.out, "latest.pth")
        if not os.path.isfile(path):
            return
        checkpoint = torch.load(path)
        self.net.load_state_dict(checkpoint["network"])
        self.opt.load_state_dict(checkpoint["optimizer"])
        self.sched.load_state_dict(checkpoint["scheduler"])
        self.step = checkpoint["step"]
        if self.rank == 0:
            print(f"resumed from {path} at step {self.step}", flush=True)

    def save(self):
        if self.rank != 0:
            return
        os.makedirs(self.args.out, exist_ok=True)
        tmp = os.path.join(self.args.out, "latest.pth.tmp")
        torch.save({"network": self.net.state_dict(), "optimizer": self.opt.state_dict(),
                    "scheduler": self.sched.state_dict(), "step": self.step}, tmp)
        os.replace(tmp, os.path.join(self.args.out, "latest.pth"))

    def train(self):
        a = self.args
        ds = ConcatDataset([LongClipDataset(a.lvos, a.frames, a.size), LongClipDataset(a.ytvos, a.frames, a.size)])
        sampler = DistributedSampler(ds, shuffle=True)
        loader = DataLoader(ds, batch_size=a.batch, sampler=sampler, num_workers=a.workers, pin_memory=True, drop_last=True)
        epoch = self.step // len(loader)
        tic = time.time()
        while self.step < a.steps:
            sampler.set_epoch(epoch)
            self.model.train()
            for clip, masks in loader:
                clip, masks = clip.to(self.device, non_blocking=True), masks.to(self.device, non_blocking=True)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = self.model(clip, masks[:, 0], a.ltm_every)
                loss = F.binary_cross_entropy_with_logits(logits.float(), masks[:, 1:])
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), 3.0)
                self.opt.step()
                self.sched.step()
                self.step += 1
                if self.rank == 0 and self.step % 50 == 0:
                    self.writer.add_scalar("loss", loss.item(), self.step)
                    print(f"step {self.step} loss {loss.item():.4f} {(time.time() - tic) / 50:.2f}s/it", flush=True)
                    tic = time.time()
                if self.step % a.save_every == 0:
                    self.save()
                if self.step % a.val_every == 0:
                    self.model.eval()
                    j, f = evaluate(self.net, a.davis, a.size, a.ltm_every, self.device)
                    self.model.train()
                    if self.rank == 0:
                        self.writer.add_scalar("val/JF", (j + f) / 2, self.step)
                        print(f"[val] step {self.step} J {j:.4f} F {f:.4f}", flush=True)
                if self.step >= a.steps:
                    break
            epoch += 1
        self.save()
        dist.barrier()
        if self.writer is not None:
            self.writer.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    Trainer(parse_args()).train()
