"""
Joint re-ID training on Market-1501 + MOT17 ground-truth crops for the tracker's
appearance branch, with an auxiliary visibility head supervised on MOT crops
(Market images carry no visibility label).

The first run cuts the MOT17 crops into --cache (shared storage); later runs reuse them.

    torchrun --nproc_per_node=4 07_mot_market_joint_vis.py \
        --market /data/Market-1501-v15.09.15 --mot /data/MOT17/train --cache /shared/cache/mot17_crops
"""
import argparse
import datetime
import json
import os
import os.path as osp
import re
import time
from collections import defaultdict
from glob import glob

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms as T
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchvision.models import resnet50, ResNet50_Weights

MOT_SEQS = ["MOT17-02-FRCNN", "MOT17-04-FRCNN", "MOT17-05-FRCNN", "MOT17-09-FRCNN",
            "MOT17-10-FRCNN", "MOT17-11-FRCNN", "MOT17-13-FRCNN"]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--market", required=True)
    p.add_argument("--mot", required=True)
    p.add_argument("--cache", required=True)
    p.add_argument("--out", default="exp/joint_vis")
    p.add_argument("--batch-per-gpu", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.02, help="lr for 256 images per optimizer step")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--vis-weight", type=float, default=0.5)
    p.add_argument("--frame-stride", type=int, default=5)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--resume", default="")
    return p.parse_args()


def cut_mot_crops(mot_root, cache, stride):
    """Crop every `stride`-th frame of each visible pedestrian box; writes index.json last."""
    index = []
    for seq in MOT_SEQS:
        gt = np.loadtxt(osp.join(mot_root, seq, "gt", "gt.txt"), delimiter=",")
        gt = gt[(gt[:, 6] == 1) & (gt[:, 7] == 1) & (gt[:, 8] >= 0.1) & (gt[:, 0] % stride == 0)]
        os.makedirs(osp.join(cache, seq), exist_ok=True)
        for frame in np.unique(gt[:, 0]).astype(int):
            img = Image.open(osp.join(mot_root, seq, "img1", f"{frame:06d}.jpg")).convert("RGB")
            for _, tid, x, y, w, h, _, _, vis in gt[gt[:, 0] == frame][:, :9]:
                if h < 50:
                    continue
                out = osp.join(cache, seq, f"{int(tid):04d}_{frame:06d}.jpg")
                img.crop((int(x), int(y), int(x + w), int(y + h))).save(out, quality=95)
                index.append([out, f"{seq}_{int(tid)}", float(vis)])
    tmp = osp.join(cache, "index.json.tmp")
    with open(tmp, "w") as f:
        json.dump(index, f)
    os.replace(tmp, osp.join(cache, "index.json"))


def market_split(folder, relabel):
    rx = re.compile(r"([-\d]+)_c(\d)")
    out = []
    for p in sorted(glob(osp.join(folder, "*.jpg"))):
        pid, cam = map(int, rx.search(osp.basename(p)).groups())
        if pid != -1:
            out.append((p, pid, cam - 1))
    if relabel:
        lut = {pid: i for i, pid in enumerate(sorted({x[1] for x in out}))}
        out = [(p, lut[pid], c) for p, pid, c in out]
    return out


class JointSet(Dataset):
    """(image, label, visibility); visibility is -1 where unknown."""

    def __init__(self, market_train, mot_index, tf):
        self.items = [(p, pid, -1.0) for p, pid, _ in market_train]
        offset = len({pid for _, pid, _ in market_train})
        mot_ids = sorted({key for _, key, _ in mot_index})
        lut = {key: offset + i for i, key in enumerate(mot_ids)}
        self.items += [(p, lut[key], vis) for p, key, vis in mot_index]
        self.num_classes = offset + len(mot_ids)
        self.tf = tf

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        p, y, vis = self.items[i]
        return self.tf(Image.open(p).convert("RGB")), y, torch.tensor(vis)


class ReIDVis(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        r = resnet50(weights=ResNet50_Weights.IMAGENET1K_V2)
        r.layer4[0].conv2.stride = (1, 1)
        r.layer4[0].downsample[0].stride = (1, 1)
        self.backbone = nn.Sequential(*list(r.children())[:-2])
        self.bnneck = nn.BatchNorm1d(2048)
        self.bnneck.bias.requires_grad_(False)
        self.classifier = nn.Linear(2048, num_classes, bias=False)
        self.vis_head = nn.Sequential(nn.Linear(2048, 256), nn.ReLU(inplace=True), nn.Linear(256, 1))

    def forward(self, x, vis_mask=None):
        f = F.adaptive_avg_pool2d(self.backbone(x), 1).flatten(1)
        b = self.bnneck(f)
        if not self.training:
            return b
        vis_pred = None
        if vis_mask is not None and vis_mask.any():
            vis_pred = self.vis_head(f[vis_mask]).squeeze(1)
        return self.classifier(b), vis_pred


@torch.no_grad()
def market_eval(net, root, tf, device):
    net.eval()
    q, g = market_split(osp.join(root, "query"), False), market_split(osp.join(root, "bounding_box_test"), False)

    class _Plain(Dataset):
        def __init__(self, items):
            self.items = items

        def __len__(self):
            return len(self.items)

        def __getitem__(self, i):
            return tf(Image.open(self.items[i][0]).convert("RGB"))

    feats = torch.cat([net(x.to(device)) for x in DataLoader(_Plain(q + g), batch_size=256, num_workers=8)])
    feats = F.normalize(feats, dim=1)
    sim = (feats[:len(q)] @ feats[len(q):].t()).cpu().numpy()
    qp, qc = np.array([x[1] for x in q]), np.array([x[2] for x in q])
    gp, gc = np.array([x[1] for x in g]), np.array([x[2] for x in g])
    aps, r1 = [], []
    for i in range(len(q)):
        order = np.argsort(-sim[i])
        keep = ~((gp[order] == qp[i]) & (gc[order] == qc[i]))
        m = gp[order][keep] == qp[i]
        if m.any():
            pos = np.flatnonzero(m)
            aps.append(np.mean(np.arange(1, len(pos) + 1) / (pos + 1)))
            r1.append(m[0])
    return float(np.mean(aps)), float(np.mean(r1))


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # rank 0 may spend a while cutting crops on the first run while the others wait
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=90))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(7)

    if rank == 0 and not osp.exists(osp.join(args.cache, "index.json")):
        print("cutting MOT17 crops ...", flush=True)
        cut_mot_crops(args.mot, args.cache, args.frame_stride)
    dist.barrier()
    with open(osp.join(args.cache, "index.json")) as f:
        mot_index = json.load(f)

    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    tf = T.Compose([T.Resize((256, 128)), T.RandomHorizontalFlip(), T.Pad(10), T.RandomCrop((256, 128)),
                    T.ToTensor(), norm, T.RandomErasing(p=0.5)])
    test_tf = T.Compose([T.Resize((256, 128)), T.ToTensor(), norm])
    train_set = JointSet(market_split(osp.join(args.market, "bounding_box_train"), True), mot_index, tf)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_per_gpu, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(ReIDVis(train_set.num_classes)).to(device)
    # vis_head only runs on batches that contain MOT crops
    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)
    images_per_step = args.batch_per_gpu * world
    lr = args.lr * images_per_step / 256
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr, momentum=0.9,
                          weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader))
    ce = nn.CrossEntropyLoss(label_smoothing=0.1)

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        net.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch = ckpt["epoch"]
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{train_set.num_classes} ids, {len(train_set)} images, {images_per_step} images/step, lr {lr:.4f}")

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        meter = torch.zeros(3, device=device)
        for x, y, vis in loader:
            x, y, vis = x.to(device, non_blocking=True), y.to(device, non_blocking=True), vis.to(device)
            mask = vis >= 0
            logits, vis_pred = model(x, mask)
            loss_id = ce(logits, y)
            loss_vis = F.smooth_l1_loss(vis_pred.sigmoid(), vis[mask]) if vis_pred is not None \
                else torch.zeros((), device=device)
            loss = loss_id + args.vis_weight * loss_vis
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            meter += torch.stack([loss_id.detach(), loss_vis.detach(), torch.ones((), device=device)])
        dist.all_reduce(meter)
        if rank == 0:
            print(f"epoch {epoch + 1}: id {meter[0] / meter[2]:.3f} vis {meter[1] / meter[2]:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch + 1}, osp.join(args.out, "last.pth"))
            if (epoch + 1) % 5 == 0:
                mAP, r1 = market_eval(net, args.market, test_tf, device)
                print(f"  market mAP {100 * mAP:.1f}  R1 {100 * r1:.1f}", flush=True)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
