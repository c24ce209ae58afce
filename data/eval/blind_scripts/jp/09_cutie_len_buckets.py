"""
Object-query memory VOS (Cutie-like) trained on variable-length clips.

Clip length depends on how long a video's annotated range is (short videos give short clips),
and every batch must share one length, so batches are built per length bucket.

    torchrun --nproc_per_node=8 train_cutie_var.py --data_root /mnt/vos --exp cutie_var
"""
import argparse
import collections
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.tensorboard import SummaryWriter
from torchvision.ops import FrozenBatchNorm2d

BUCKETS = (4, 8, 12, 16)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_root", required=True, help="contains YouTube/ and DAVIS/")
    p.add_argument("--exp", default="cutie_var")
    p.add_argument("--batch_size", type=int, default=4, help="clips per GPU")
    p.add_argument("--size", type=int, default=384)
    p.add_argument("--num_queries", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=25)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--seed", type=int, default=3407)
    return p.parse_args()


def load_rgb(path, size):
    x = torchvision.transforms.functional.to_tensor(Image.open(path).convert("RGB").resize((size, size), Image.BILINEAR))
    return torchvision.transforms.functional.normalize(x, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])


class VarLenVOS(Dataset):
    def __init__(self, root, size):
        self.root, self.size = root, size
        self.items = []
        for v in sorted(os.listdir(os.path.join(root, "Annotations"))):
            frames = sorted(f[:-4] for f in os.listdir(os.path.join(root, "Annotations", v)))
            fit = [b for b in BUCKETS if b <= len(frames)]
            if fit:
                self.items.append((v, frames, fit[-1]))

    def __len__(self):
        return len(self.items)

    def clip_len(self, i):
        return self.items[i][2]

    def __getitem__(self, i):
        v, frames, t = self.items[i]
        s = random.randint(0, len(frames) - t)
        names = frames[s:s + t]
        imgs = torch.stack([load_rgb(os.path.join(self.root, "JPEGImages", v, n + ".jpg"), self.size) for n in names])
        anns = np.stack([np.asarray(Image.open(os.path.join(self.root, "Annotations", v, n + ".png")).resize((self.size, self.size), Image.NEAREST)) for n in names])
        objs = [o for o in np.unique(anns[0]) if o != 0]
        o = random.choice(objs) if objs else 255
        return imgs, torch.from_numpy((anns == o).astype(np.float32))


class DistributedBucketBatchSampler(Sampler):
    """Shards the dataset over ranks, then forms same-length batches inside each shard."""

    def __init__(self, dataset, batch_size, num_replicas, rank, seed=0):
        self.dataset, self.batch_size = dataset, batch_size
        self.num_replicas, self.rank, self.seed, self.epoch = num_replicas, rank, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _batches(self):
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.dataset), generator=g).tolist()
        shard = order[self.rank::self.num_replicas]
        buckets = collections.defaultdict(list)
        for i in shard:
            buckets[self.dataset.clip_len(i)].append(i)
        batches = []
        for length in sorted(buckets):
            idx = buckets[length]
            batches += [idx[k:k + self.batch_size] for k in range(0, len(idx) - self.batch_size + 1, self.batch_size)]
        perm = torch.randperm(len(batches), generator=g).tolist()
        return [batches[p] for p in perm]

    def __iter__(self):
        return iter(self._batches())

    def __len__(self):
        return len(self._batches())


class ObjectQueryVOS(nn.Module):
    def __init__(self, num_queries=16, dim=256):
        super().__init__()
        r = torchvision.models.resnet50(weights="IMAGENET1K_V2", norm_layer=FrozenBatchNorm2d)
        self.stem = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool, r.layer1)
        self.l2, self.l3 = r.layer2, r.layer3
        self.pix = nn.Conv2d(1024, dim, 1)
        self.key = nn.Conv2d(1024, 64, 1)
        self.mask_val = nn.Sequential(nn.Conv2d(dim + 1, dim, 3, padding=1), nn.GroupNorm(16, dim), nn.GELU(), nn.Conv2d(dim, dim, 3, padding=1))
        self.queries = nn.Parameter(torch.randn(1, num_queries, dim) * 0.02)
        self.q_read = nn.MultiheadAttention(dim, 8, batch_first=True)
        self.q_ffn = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.p_read = nn.MultiheadAttention(dim, 8, batch_first=True)
        self.up8 = nn.Sequential(nn.Conv2d(dim + 512, 128, 3, padding=1), nn.GroupNorm(16, 128), nn.ReLU())
        self.up4 = nn.Sequential(nn.Conv2d(128 + 256, 64, 3, padding=1), nn.GroupNorm(8, 64), nn.ReLU())
        self.out = nn.Conv2d(64, 1, 1)

    def encode(self, x):
        f4 = self.stem(x)
        f8 = self.l2(f4)
        f16 = self.l3(f8)
        return self.key(f16), self.pix(f16), f8, f4

    def memory_value(self, pix, mask):
        m = F.interpolate(mask[:, None], size=pix.shape[-2:], mode="bilinear", align_corners=False)
        return self.mask_val(torch.cat([pix, m], 1))

    def step(self, k, pix, f8, f4, mem_k, mem_v, out_size):
        b, c, h, w = pix.shape
        aff = torch.einsum("bcn,bcm->bnm", mem_k, k.flatten(2)) / 8.0
        readout = torch.einsum("bcn,bnm->bcm", mem_v, aff.softmax(1))                  # B C HW
        tok = (pix.flatten(2) + readout).transpose(1, 2)
        q = self.queries.expand(b, -1, -1)
        q = q + self.q_read(q, tok, tok, need_weights=False)[0]
        q = q + self.q_ffn(q)
        tok = tok + self.p_read(tok, q, q, need_weights=False)[0]
        x = tok.transpose(1, 2).reshape(b, c, h, w)
        x = self.up8(torch.cat([F.interpolate(x, size=f8.shape[-2:], mode="bilinear", align_corners=False), f8], 1))
        x = self.up4(torch.cat([F.interpolate(x, size=f4.shape[-2:], mode="bilinear", align_corners=False), f4], 1))
        return F.interpolate(self.out(x), size=out_size, mode="bilinear", align_corners=False)[:, 0]

    def forward(self, clip, mask0):
        B, T = clip.shape[:2]
        k, pix, f8, f4 = [x.unflatten(0, (B, T)) for x in self.encode(clip.flatten(0, 1))]
        mem_k, mem_v = [k[:, 0].flatten(2)], [self.memory_value(pix[:, 0], mask0).flatten(2)]
        outs = []
        for t in range(1, T):
            lg = self.step(k[:, t], pix[:, t], f8[:, t], f4[:, t], torch.cat(mem_k, 2), torch.cat(mem_v, 2), clip.shape[-2:])
            outs.append(lg)
            mem_k.append(k[:, t].flatten(2))
            mem_v.append(self.memory_value(pix[:, t], torch.sigmoid(lg)).flatten(2))
        return torch.stack(outs, 1)


def j_and_f(pred, gt):
    u = (pred | gt).sum()
    j = 1.0 if u == 0 else (pred & gt).sum() / u
    tt = torch.from_numpy(np.stack([pred, gt])).float()[:, None]
    e = (tt + F.max_pool2d(-tt, 3, 1, 1)) > 0
    d = F.max_pool2d(e.float(), 7, 1, 3) > 0
    if e.sum() == 0:
        return j, 1.0
    p = (e[0] & d[1]).sum().item() / max(e[0].sum().item(), 1)
    r = (e[1] & d[0]).sum().item() / max(e[1].sum().item(), 1)
    return j, 0.0 if p + r == 0 else 2 * p * r / (p + r)


@torch.no_grad()
def evaluate(net, davis, size, device, rank, world):
    seqs = open(os.path.join(davis, "ImageSets/2017/val.txt")).read().split()
    acc = torch.zeros(3, device=device, dtype=torch.float64)
    for seq in seqs[rank::world]:
        names = sorted(os.listdir(os.path.join(davis, "JPEGImages/480p", seq)))
        imgs = torch.stack([load_rgb(os.path.join(davis, "JPEGImages/480p", seq, n), size) for n in names]).to(device)
        gts = np.stack([np.asarray(Image.open(os.path.join(davis, "Annotations/480p", seq, n[:-4] + ".png")).resize((size, size), Image.NEAREST)) for n in names])
        k, pix, f8, f4 = net.encode(imgs)
        res = []
        for o in [o for o in np.unique(gts[0]) if o != 0]:
            mk = [k[:1].flatten(2)]
            mv = [net.memory_value(pix[:1], torch.from_numpy((gts[0] == o).astype(np.float32)).to(device)[None]).flatten(2)]
            for t in range(1, len(names)):
                lg = net.step(k[t:t + 1], pix[t:t + 1], f8[t:t + 1], f4[t:t + 1], torch.cat(mk, 2), torch.cat(mv, 2), (size, size))
                res.append(j_and_f((lg[0] > 0).cpu().numpy(), gts[t] == o))
                if t % 5 == 0:
                    mk.append(k[t:t + 1].flatten(2))
                    mv.append(net.memory_value(pix[t:t + 1], torch.sigmoid(lg)).flatten(2))
        js, fs = zip(*res)
        acc += torch.tensor([np.mean(js), np.mean(fs), 1.0], device=device, dtype=torch.float64)
    dist.all_reduce(acc)
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


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

    ds = VarLenVOS(os.path.join(args.data_root, "YouTube", "train"), args.size)
    batch_sampler = DistributedBucketBatchSampler(ds, args.batch_size, world, rank, seed=args.seed)
    loader = DataLoader(ds, batch_sampler=batch_sampler, num_workers=args.workers, pin_memory=True)

    model = DDP(ObjectQueryVOS(args.num_queries).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr * world * args.batch_size / 32, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(batch_sampler), eta_min=1e-6)
    writer = SummaryWriter(os.path.join("runs", args.exp)) if rank == 0 else None
    ckpt_dir = os.path.join("checkpoints", args.exp)
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)

    global_step, best = 0, -1.0
    for epoch in range(args.epochs):
        batch_sampler.set_epoch(epoch)
        model.train()
        for clip, masks in loader:
            clip, masks = clip.to(device, non_blocking=True), masks.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(clip, masks[:, 0])
            target = masks[:, 1:]
            prob = torch.sigmoid(logits.float())
            dice = 1 - (2 * (prob * target).flatten(2).sum(-1) + 1) / (prob.flatten(2).sum(-1) + target.flatten(2).sum(-1) + 1)
            loss = F.binary_cross_entropy_with_logits(logits.float(), target) + dice.mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            global_step += 1
            if writer is not None and global_step % 25 == 0:
                writer.add_scalar("train/loss", loss.item(), global_step)
                writer.add_scalar("train/clip_len", clip.shape[1], global_step)

        model.eval()
        j, f = evaluate(model.module, os.path.join(args.data_root, "DAVIS"), args.size, device, rank, world)
        if rank == 0:
            jf = (j + f) / 2
            writer.add_scalar("val/J&F", jf, epoch)
            print(f"epoch {epoch}: J {j:.4f} F {f:.4f} J&F {jf:.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "jf": jf}, os.path.join(ckpt_dir, "last.pth"))
            if jf > best:
                best = jf
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "jf": jf}, os.path.join(ckpt_dir, "best.pth"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
