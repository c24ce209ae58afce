"""
Quality-aware memory VOS (QDMN-style: frames enter memory only if the predicted mask quality is high).
Validation keeps the per-sequence J&F of every DAVIS-17 val sequence, so the table by sequence
can be logged next to the mean.

    torchrun --nproc_per_node=4 train_qdmn.py configs/qdmn_s3.yaml
    torchrun --nproc_per_node=4 train_qdmn.py configs/qdmn_s3.yaml train.lr=5e-5
"""
import os
import random
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from omegaconf import OmegaConf
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision.ops import FrozenBatchNorm2d

DEFAULT_CFG = OmegaConf.create({
    "data": {"davis": "data/DAVIS/2017/trainval", "youtube": "data/YouTube/train_480p", "size": 384, "num_frames": 3, "workers": 8},
    "train": {"batch_per_gpu": 4, "lr": 2e-5, "iters": 150000, "decay_at": 125000, "quality_loss_w": 0.5, "log_every": 100},
    "val": {"every": 10000, "mem_every": 5, "quality_thresh": 0.8},
    "out": "exp/qdmn_s3",
})


def to_tensor(img):
    return torchvision.transforms.functional.normalize(torchvision.transforms.functional.to_tensor(img),
                                                       [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])


class TripletClips(Dataset):
    def __init__(self, img_root, ann_root, size, num_frames, max_jump=20):
        self.img_root, self.ann_root, self.size, self.n, self.max_jump = img_root, ann_root, size, num_frames, max_jump
        self.videos = []
        for v in sorted(os.listdir(ann_root)):
            names = sorted(a[:-4] for a in os.listdir(os.path.join(ann_root, v)))
            if len(names) >= num_frames:
                self.videos.append((v, names))

    def __len__(self):
        return len(self.videos)

    def __getitem__(self, i):
        v, names = self.videos[i]
        idx = sorted(random.sample(range(len(names)), self.n))
        while idx[-1] - idx[0] > self.max_jump * (self.n - 1):
            idx = sorted(random.sample(range(len(names)), self.n))
        imgs = [to_tensor(Image.open(os.path.join(self.img_root, v, names[k] + ".jpg")).convert("RGB").resize((self.size, self.size), Image.BILINEAR)) for k in idx]
        anns = np.stack([np.asarray(Image.open(os.path.join(self.ann_root, v, names[k] + ".png")).resize((self.size, self.size), Image.NEAREST)) for k in idx])
        objs = [o for o in np.unique(anns[0]) if o != 0]
        o = random.choice(objs) if objs else -1
        return torch.stack(imgs), torch.from_numpy((anns == o).astype(np.float32))


class QDMN(nn.Module):
    def __init__(self, key_dim=64, val_dim=512):
        super().__init__()
        r50 = torchvision.models.resnet50(weights="IMAGENET1K_V1", norm_layer=FrozenBatchNorm2d)
        self.stem = nn.Sequential(r50.conv1, r50.bn1, r50.relu, r50.maxpool, r50.layer1)
        self.res3, self.res4 = r50.layer2, r50.layer3
        r18 = torchvision.models.resnet18(weights="IMAGENET1K_V1", norm_layer=FrozenBatchNorm2d)
        conv1 = nn.Conv2d(4, 64, 7, 2, 3, bias=False)
        conv1.weight.data[:, :3] = r18.conv1.weight.data
        conv1.weight.data[:, 3:] = 0
        self.venc = nn.Sequential(conv1, r18.bn1, r18.relu, r18.maxpool, r18.layer1, r18.layer2, r18.layer3)
        self.key_proj = nn.Conv2d(1024, key_dim, 3, padding=1)
        self.val_proj = nn.Conv2d(1024 + 256, val_dim, 3, padding=1)
        self.fuse = nn.Conv2d(1024 + val_dim, 256, 3, padding=1)
        self.up8 = nn.Conv2d(256 + 512, 128, 3, padding=1)
        self.up4 = nn.Conv2d(128 + 256, 64, 3, padding=1)
        self.pred = nn.Conv2d(64, 1, 1)
        self.quality = nn.Sequential(nn.Conv2d(1024 + 1, 256, 3, 2, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, 1))

    def encode(self, x):
        f4 = self.stem(x)
        f8 = self.res3(f4)
        f16 = self.res4(f8)
        return self.key_proj(f16), f16, f8, f4

    def memorize(self, img, mask, f16):
        return self.val_proj(torch.cat([f16, self.venc(torch.cat([img, mask[:, None]], 1))], 1))

    def segment(self, qk, f16, f8, f4, mk, mv, hw):
        b, c, h, w = qk.shape
        aff = (2 * mk.transpose(1, 2) @ qk.flatten(2) - mk.pow(2).sum(1, keepdim=True).transpose(1, 2)) / c ** 0.5
        read = (mv @ aff.softmax(1)).view(b, -1, h, w)
        x = F.relu(self.fuse(torch.cat([f16, read], 1)))
        x = F.relu(self.up8(torch.cat([F.interpolate(x, size=f8.shape[-2:], mode="bilinear", align_corners=False), f8], 1)))
        x = F.relu(self.up4(torch.cat([F.interpolate(x, size=f4.shape[-2:], mode="bilinear", align_corners=False), f4], 1)))
        logit = F.interpolate(self.pred(x), size=hw, mode="bilinear", align_corners=False)[:, 0]
        q = self.quality(torch.cat([f16, F.interpolate(torch.sigmoid(logit)[:, None], size=f16.shape[-2:], mode="bilinear", align_corners=False)], 1))
        return logit, q[:, 0]

    def forward(self, frames, mask0):
        B, T = frames.shape[:2]
        k, f16, f8, f4 = [x.unflatten(0, (B, T)) for x in self.encode(frames.flatten(0, 1))]
        mk, mv = [k[:, 0].flatten(2)], [self.memorize(frames[:, 0], mask0, f16[:, 0]).flatten(2)]
        logits, quals = [], []
        for t in range(1, T):
            lg, q = self.segment(k[:, t], f16[:, t], f8[:, t], f4[:, t], torch.cat(mk, 2), torch.cat(mv, 2), frames.shape[-2:])
            logits.append(lg)
            quals.append(q)
            if t < T - 1:
                mk.append(k[:, t].flatten(2))
                mv.append(self.memorize(frames[:, t], torch.sigmoid(lg), f16[:, t]).flatten(2))
        return torch.stack(logits, 1), torch.stack(quals, 1)


def jf_frame(pred, gt):
    u = (pred | gt).sum()
    j = 1.0 if u == 0 else (pred & gt).sum() / u
    t = torch.from_numpy(np.stack([pred, gt]).astype(np.float32))[:, None]
    e = (t + F.max_pool2d(-t, 3, 1, 1)) > 0
    d = F.max_pool2d(e.float(), 7, 1, 3) > 0
    if not e.any():
        return j, 1.0
    p = (e[0] & d[1]).sum().item() / max(e[0].sum().item(), 1)
    r = (e[1] & d[0]).sum().item() / max(e[1].sum().item(), 1)
    return j, 0.0 if p + r == 0 else 2 * p * r / (p + r)


@torch.no_grad()
def run_val(net, cfg, device, rank, world):
    root = cfg.data.davis
    seqs = sorted(open(os.path.join(root, "ImageSets/2017/val.txt")).read().split())
    mine = seqs[rank::world]
    seq_scores = []
    for seq in mine:
        names = sorted(os.listdir(os.path.join(root, "JPEGImages/480p", seq)))
        size = cfg.data.size
        imgs = torch.stack([to_tensor(Image.open(os.path.join(root, "JPEGImages/480p", seq, n)).convert("RGB").resize((size, size), Image.BILINEAR)) for n in names]).to(device)
        gts = np.stack([np.asarray(Image.open(os.path.join(root, "Annotations/480p", seq, n[:-4] + ".png")).resize((size, size), Image.NEAREST)) for n in names])
        k, f16, f8, f4 = net.encode(imgs)
        res = []
        for o in [o for o in np.unique(gts[0]) if o != 0]:
            m0 = torch.from_numpy((gts[0] == o).astype(np.float32)).to(device)[None]
            mk, mv = [k[:1].flatten(2)], [net.memorize(imgs[:1], m0, f16[:1]).flatten(2)]
            for t in range(1, len(names)):
                lg, q = net.segment(k[t:t + 1], f16[t:t + 1], f8[t:t + 1], f4[t:t + 1], torch.cat(mk, 2), torch.cat(mv, 2), (size, size))
                res.append(jf_frame((lg[0] > 0).cpu().numpy(), gts[t] == o))
                if t % cfg.val.mem_every == 0 and torch.sigmoid(q).item() > cfg.val.quality_thresh:
                    mk.append(k[t:t + 1].flatten(2))
                    mv.append(net.memorize(imgs[t:t + 1], torch.sigmoid(lg), f16[t:t + 1]).flatten(2))
        js, fs = zip(*res)
        seq_scores.append([np.mean(js), np.mean(fs)])
    local = torch.tensor(seq_scores, dtype=torch.float32, device=device)
    gathered = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    # rank r evaluated seqs[r::world]; put the rows back in sequence order
    table = {}
    for r, part in enumerate(gathered):
        for name, (j, f) in zip(seqs[r::world], part.tolist()):
            table[name] = (j, f)
    return table


def main():
    cfg = OmegaConf.merge(DEFAULT_CFG, OmegaConf.load(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].endswith(".yaml") else {},
                          OmegaConf.from_dotlist([a for a in sys.argv[1:] if "=" in a]))
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(rank)
    np.random.seed(rank)

    net = QDMN().to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=cfg.train.lr * world / 4, weight_decay=1e-7)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [cfg.train.decay_at], 0.1)

    d, y = cfg.data.davis, cfg.data.youtube
    ds = ConcatDataset([TripletClips(os.path.join(d, "JPEGImages/480p"), os.path.join(d, "Annotations/480p"), cfg.data.size, cfg.data.num_frames)] * 5
                       + [TripletClips(os.path.join(y, "JPEGImages"), os.path.join(y, "Annotations"), cfg.data.size, cfg.data.num_frames)])
    sampler = DistributedSampler(ds, shuffle=True)
    loader = DataLoader(ds, batch_size=cfg.train.batch_per_gpu, sampler=sampler, num_workers=cfg.data.workers,
                        pin_memory=True, drop_last=True)
    writer = SummaryWriter(cfg.out) if rank == 0 else None
    if rank == 0:
        os.makedirs(cfg.out, exist_ok=True)
        OmegaConf.save(cfg, os.path.join(cfg.out, "config.yaml"))

    it, epoch, tic = 0, 0, time.time()
    while it < cfg.train.iters:
        sampler.set_epoch(epoch)
        for frames, masks in loader:
            frames, masks = frames.to(device, non_blocking=True), masks.to(device, non_blocking=True)
            logits, quals = model(frames, masks[:, 0])
            tgt = masks[:, 1:]
            seg = F.binary_cross_entropy_with_logits(logits, tgt)
            with torch.no_grad():
                pred = (logits > 0).float()
                iou = (pred * tgt).flatten(2).sum(-1) / ((pred + tgt).clamp(max=1).flatten(2).sum(-1) + 1e-6)
            loss = seg + cfg.train.quality_loss_w * F.binary_cross_entropy_with_logits(quals, iou)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            it += 1
            if rank == 0 and it % cfg.train.log_every == 0:
                writer.add_scalar("train/seg", seg.item(), it)
                writer.add_scalar("train/total", loss.item(), it)
                print(f"it {it} loss {loss.item():.4f} {(time.time() - tic) / cfg.train.log_every:.2f}s/it", flush=True)
                tic = time.time()
            if it % cfg.val.every == 0:
                model.eval()
                table = run_val(net, cfg, device, rank, world)
                model.train()
                if rank == 0:
                    j = np.mean([v[0] for v in table.values()])
                    f = np.mean([v[1] for v in table.values()])
                    writer.add_scalar("val/J&F", (j + f) / 2, it)
                    writer.add_text("val/per_sequence", "\n".join(f"{k}: {(a + b) / 2:.3f}" for k, (a, b) in sorted(table.items())), it)
                    print(f"[val] it {it} J {j:.4f} F {f:.4f} J&F {(j + f) / 2:.4f}", flush=True)
                    torch.save(net.state_dict(), os.path.join(cfg.out, f"qdmn_{it}.pth"))
            if it >= cfg.train.iters:
                break
        epoch += 1

    if rank == 0:
        torch.save(net.state_dict(), os.path.join(cfg.out, "qdmn_final.pth"))
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
