"""Two-view pipeline: frozen SuperPoint (online extraction) + trainable attentional matcher, homography pairs.

    torchrun --nproc_per_node=4 15_twoview_pipeline_online_sp.py --images /data/revisitop1m/jpg \
        --sp_weights weights/superpoint_v1.pth --out outputs/twoview_sp_matcher
"""
import argparse
import glob
import logging
import os

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("twoview")


class HomographyImages(Dataset):
    def __init__(self, root, size=(480, 640), difficulty=0.3):
        self.files = sorted(glob.glob(os.path.join(root, "*", "*.jpg")))
        self.h, self.w = size
        self.difficulty = difficulty

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        img = cv2.imread(self.files[i], cv2.IMREAD_GRAYSCALE)
        img = cv2.resize(img, (self.w, self.h), interpolation=cv2.INTER_AREA)
        src = np.float32([[0, 0], [self.w, 0], [self.w, self.h], [0, self.h]])
        jitter = np.random.uniform(-1, 1, (4, 2)) * self.difficulty * np.float32([self.w, self.h]) / 2
        H = cv2.getPerspectiveTransform(src, (src + jitter).astype(np.float32))
        warped = cv2.warpPerspective(img, H, (self.w, self.h))
        f = lambda a: torch.from_numpy(a.astype(np.float32) / 255.0)[None]
        return {"view0": f(img), "view1": f(warped), "H_0to1": torch.from_numpy(H.astype(np.float32))}


class SuperPoint(nn.Module):
    def __init__(self, max_kpts=512, nms=4):
        super().__init__()
        ch = [(1, 64), (64, 64), (64, 64), (64, 64), (64, 128), (128, 128), (128, 128), (128, 128)]
        names = ["conv1a", "conv1b", "conv2a", "conv2b", "conv3a", "conv3b", "conv4a", "conv4b"]
        for n, (i, o) in zip(names, ch):
            setattr(self, n, nn.Conv2d(i, o, 3, 1, 1))
        self.names = names
        self.convPa, self.convPb = nn.Conv2d(128, 256, 3, 1, 1), nn.Conv2d(256, 65, 1)
        self.convDa, self.convDb = nn.Conv2d(128, 256, 3, 1, 1), nn.Conv2d(256, 256, 1)
        self.max_kpts, self.nms = max_kpts, nms

    @torch.no_grad()
    def forward(self, img):
        x = img
        for k, n in enumerate(self.names):
            x = F.relu(getattr(self, n)(x))
            if k in (1, 3, 5):
                x = F.max_pool2d(x, 2)
        scores = F.pixel_shuffle(self.convPb(F.relu(self.convPa(x))).softmax(1)[:, :-1], 8)[:, 0]
        desc = F.normalize(self.convDb(F.relu(self.convDa(x))), dim=1)
        nms = scores == F.max_pool2d(scores[:, None], 2 * self.nms + 1, 1, self.nms)[:, 0]
        s = (scores * nms)
        s[:, :4], s[:, -4:], s[:, :, :4], s[:, :, -4:] = 0, 0, 0, 0
        val, idx = s.flatten(1).topk(self.max_kpts, dim=1)
        w = scores.size(-1)
        kpts = torch.stack([idx % w, idx // w], -1).float()
        g = torch.stack([kpts[..., 0] / (w - 1), kpts[..., 1] / (scores.size(-2) - 1)], -1) * 2 - 1
        d = F.normalize(F.grid_sample(desc, g[:, None], align_corners=True)[:, :, 0], dim=1).transpose(1, 2)
        return {"keypoints": kpts, "scores": val, "descriptors": d, "image_size": img.shape[-2:]}


class AttentionalMatcher(nn.Module):
    def __init__(self, dim=256, layers=7, heads=4):
        super().__init__()
        self.kenc = nn.Sequential(nn.Linear(3, 64), nn.ReLU(), nn.Linear(64, dim))
        self.self_attn = nn.ModuleList([nn.MultiheadAttention(dim, heads, batch_first=True) for _ in range(layers)])
        self.cross_attn = nn.ModuleList([nn.MultiheadAttention(dim, heads, batch_first=True) for _ in range(layers)])
        self.ffn = nn.ModuleList([nn.Sequential(nn.Linear(2 * dim, 2 * dim), nn.LayerNorm(2 * dim), nn.GELU(),
                                                nn.Linear(2 * dim, dim)) for _ in range(2 * layers)])
        self.final = nn.Linear(dim, dim)
        self.matchability = nn.Linear(dim, 1)

    def forward(self, f0, f1):
        h, w = f0["image_size"]
        norm = lambda k: (k - k.new_tensor([w / 2, h / 2])) / (max(h, w) / 2)
        x0 = f0["descriptors"] + self.kenc(torch.cat([norm(f0["keypoints"]), f0["scores"][..., None]], -1))
        x1 = f1["descriptors"] + self.kenc(torch.cat([norm(f1["keypoints"]), f1["scores"][..., None]], -1))
        for i, (sa, ca) in enumerate(zip(self.self_attn, self.cross_attn)):
            m0, m1 = sa(x0, x0, x0, need_weights=False)[0], sa(x1, x1, x1, need_weights=False)[0]
            x0, x1 = x0 + self.ffn[2 * i](torch.cat([x0, m0], -1)), x1 + self.ffn[2 * i](torch.cat([x1, m1], -1))
            m0, m1 = ca(x0, x1, x1, need_weights=False)[0], ca(x1, x0, x0, need_weights=False)[0]
            x0, x1 = (x0 + self.ffn[2 * i + 1](torch.cat([x0, m0], -1)),
                      x1 + self.ffn[2 * i + 1](torch.cat([x1, m1], -1)))
        p0, p1 = self.final(x0), self.final(x1)
        sim = p0 @ p1.transpose(1, 2) / p0.size(-1) ** 0.5
        z0, z1 = self.matchability(x0), self.matchability(x1)
        log_assign = sim.log_softmax(2) + sim.log_softmax(1) + F.logsigmoid(z0) + F.logsigmoid(z1).transpose(1, 2)
        return {"log_assignment": log_assign, "unmatched0": F.logsigmoid(-z0)[..., 0],
                "unmatched1": F.logsigmoid(-z1)[..., 0]}


class TwoViewPipeline(nn.Module):
    def __init__(self, sp_weights, gt_thresh=3.0):
        super().__init__()
        self.extractor = SuperPoint()
        self.extractor.load_state_dict(torch.load(sp_weights, map_location="cpu"))
        self.extractor.requires_grad_(False)
        self.matcher = AttentionalMatcher()
        self.gt_thresh = gt_thresh

    def forward(self, data):
        f0, f1 = self.extractor(data["view0"]), self.extractor(data["view1"])
        pred = self.matcher(f0, f1)
        pred.update({"keypoints0": f0["keypoints"], "keypoints1": f1["keypoints"]})
        return pred

    @torch.no_grad()
    def ground_truth(self, pred, H):
        k0 = torch.cat([pred["keypoints0"], torch.ones_like(pred["keypoints0"][..., :1])], -1) @ H.transpose(1, 2)
        k0 = k0[..., :2] / k0[..., 2:]
        d = torch.cdist(k0, pred["keypoints1"])
        m01, m10 = d.argmin(2), d.argmin(1)
        ar = torch.arange(d.size(1), device=d.device)[None]
        mutual = m10.gather(1, m01) == ar
        ok = mutual & (d.min(2).values < self.gt_thresh)
        gt0 = torch.where(ok, m01, torch.full_like(m01, -1))
        gt1 = torch.full_like(m10, -1)
        b, i = ok.nonzero(as_tuple=True)
        gt1[b, m01[b, i]] = i
        return gt0, gt1

    def loss(self, pred, data):
        gt0, gt1 = self.ground_truth(pred, data["H_0to1"])
        b, i = (gt0 >= 0).nonzero(as_tuple=True)
        pos = -pred["log_assignment"][b, i, gt0[b, i]]
        neg0 = -pred["unmatched0"][gt0 < 0]
        neg1 = -pred["unmatched1"][gt1 < 0]
        loss = (pos.sum() + neg0.sum() + neg1.sum()) / (pos.numel() + neg0.numel() + neg1.numel())
        with torch.no_grad():
            pm = pred["log_assignment"].argmax(2)
            precision = (pm[b, i] == gt0[b, i]).float().mean() if len(b) else loss.new_zeros(())
        return loss, {"match_recall": precision, "num_gt": loss.new_tensor(float(len(b)) / gt0.size(0))}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", required=True)
    ap.add_argument("--sp_weights", required=True)
    ap.add_argument("--out", default="outputs/twoview")
    ap.add_argument("--batch_size", type=int, default=24)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--log_every", type=int, default=100)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank{rank}] %(asctime)s %(message)s")

    dataset = HomographyImages(args.images)
    sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, args.batch_size, sampler=sampler, num_workers=args.workers, pin_memory=True,
                        drop_last=True, worker_init_fn=lambda w: np.random.seed(torch.initial_seed() % 2 ** 32))

    model = TwoViewPipeline(args.sp_weights).to(device)
    model = DDP(model, device_ids=[local_rank])
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(trainable, lr=args.lr)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.95)
    logger.info("trainable params: %.2fM", sum(p.numel() for p in trainable) / 1e6)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for data in loader:
            data = {k: v.to(device, non_blocking=True) for k, v in data.items()}
            pred = model(data)
            loss, metrics = model.loss(pred, data)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            if step % args.log_every == 0:
                vals = torch.stack([loss.detach(), metrics["match_recall"], metrics["num_gt"]])
                dist.all_reduce(vals, op=dist.ReduceOp.AVG)
                logger.info("epoch %d step %d loss %.4f recall %.3f gt/pair %.1f", epoch, step, *vals.tolist())
            step += 1
        scheduler.step()
        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            torch.save({"matcher": model.module.matcher.state_dict(), "optimizer": optimizer.state_dict(),
                        "epoch": epoch}, os.path.join(args.out, f"checkpoint_{epoch:03d}.tar"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
