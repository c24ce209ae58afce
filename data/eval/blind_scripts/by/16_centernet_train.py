"""CenterNet (objects as points) with a ResNet-18 + deconv backbone, COCO 512x512.

    torchrun --nproc_per_node=4 centernet_train.py --data /data/coco --batch-size 32 --epochs 140
"""
import argparse
import math
import os
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

MEAN = np.array([0.408, 0.447, 0.470], np.float32)
STD = np.array([0.289, 0.274, 0.278], np.float32)


def get_args():
    parser = argparse.ArgumentParser("CenterNet")
    parser.add_argument("--data", default="/data/coco")
    parser.add_argument("--input-res", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=32, help="per GPU")
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--epochs", type=int, default=140)
    parser.add_argument("--lr-step", type=int, nargs="+", default=[90, 120])
    parser.add_argument("--num-workers", type=int, default=8)
    parser.add_argument("--save-dir", default="exp/ctdet_res18")
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


def gaussian_radius(h, w, min_overlap=0.7):
    a1, b1, c1 = 1, h + w, w * h * (1 - min_overlap) / (1 + min_overlap)
    r1 = (b1 + math.sqrt(b1 ** 2 - 4 * a1 * c1)) / 2
    a2, b2, c2 = 4, 2 * (h + w), (1 - min_overlap) * w * h
    r2 = (b2 + math.sqrt(b2 ** 2 - 4 * a2 * c2)) / 2
    a3, b3, c3 = 4 * min_overlap, -2 * min_overlap * (h + w), (min_overlap - 1) * w * h
    r3 = (b3 + math.sqrt(b3 ** 2 - 4 * a3 * c3)) / 2
    return min(r1, r2, r3)


def draw_gaussian(heatmap, center, radius):
    d = 2 * radius + 1
    sigma = d / 6
    y, x = np.ogrid[-radius:radius + 1, -radius:radius + 1]
    g = np.exp(-(x * x + y * y) / (2 * sigma * sigma))
    cx, cy = int(center[0]), int(center[1])
    H, W = heatmap.shape
    l, r = min(cx, radius), min(W - cx, radius + 1)
    t, b = min(cy, radius), min(H - cy, radius + 1)
    np.maximum(heatmap[cy - t:cy + b, cx - l:cx + r], g[radius - t:radius + b, radius - l:radius + r],
               out=heatmap[cy - t:cy + b, cx - l:cx + r])


class CocoCenterNet(Dataset):
    max_objs = 128

    def __init__(self, root, split, res, train):
        self.coco = COCO(f"{root}/annotations/instances_{split}2017.json")
        self.img_dir = f"{root}/{split}2017"
        self.ids = sorted(self.coco.getImgIds())
        self.cat_ids = sorted(self.coco.getCatIds())
        self.cat2id = {c: i for i, c in enumerate(self.cat_ids)}
        self.res, self.out = res, res // 4
        self.train = train

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, idx):
        iid = self.ids[idx]
        img = cv2.imread(os.path.join(self.img_dir, self.coco.imgs[iid]["file_name"]))
        h, w = img.shape[:2]
        s = self.res / max(h, w)
        if self.train:
            s *= np.random.choice(np.arange(0.6, 1.4, 0.1))
        flipped = self.train and np.random.rand() < 0.5
        M = np.array([[s, 0, (self.res - w * s) / 2], [0, s, (self.res - h * s) / 2]], np.float32)
        inp = cv2.warpAffine(img, M, (self.res, self.res), flags=cv2.INTER_LINEAR, borderValue=(0, 0, 0))
        if flipped:
            inp = inp[:, ::-1]
        inp = ((inp[..., ::-1].astype(np.float32) / 255.0 - MEAN) / STD).transpose(2, 0, 1).copy()

        hm = np.zeros((len(self.cat_ids), self.out, self.out), np.float32)
        wh = np.zeros((self.max_objs, 2), np.float32)
        reg = np.zeros((self.max_objs, 2), np.float32)
        ind = np.zeros(self.max_objs, np.int64)
        mask = np.zeros(self.max_objs, np.float32)
        anns = self.coco.loadAnns(self.coco.getAnnIds(imgIds=iid, iscrowd=False))[: self.max_objs]
        for k, a in enumerate(anns):
            x, y, bw, bh = a["bbox"]
            box = np.array([x, y, x + bw, y + bh], np.float32) * s
            box[[0, 2]] += M[0, 2]
            box[[1, 3]] += M[1, 2]
            if flipped:
                box[[0, 2]] = self.res - box[[2, 0]]
            box = np.clip(box / 4, 0, self.out - 1)
            bh_o, bw_o = box[3] - box[1], box[2] - box[0]
            if bh_o <= 0 or bw_o <= 0:
                continue
            radius = max(0, int(gaussian_radius(math.ceil(bh_o), math.ceil(bw_o))))
            ct = np.array([(box[0] + box[2]) / 2, (box[1] + box[3]) / 2], np.float32)
            ct_int = ct.astype(np.int32)
            draw_gaussian(hm[self.cat2id[a["category_id"]]], ct_int, radius)
            wh[k] = bw_o, bh_o
            ind[k] = ct_int[1] * self.out + ct_int[0]
            reg[k] = ct - ct_int
            mask[k] = 1
        meta = np.array([iid, s, M[0, 2], M[1, 2]], np.float64)
        return torch.from_numpy(inp), {"hm": hm, "wh": wh, "reg": reg, "ind": ind, "mask": mask}, meta


class CenterNet(nn.Module):
    def __init__(self, num_classes=80, head_conv=64):
        super().__init__()
        r18 = torchvision.models.resnet18(weights="IMAGENET1K_V1")
        self.backbone = nn.Sequential(*list(r18.children())[:-2])
        layers, c = [], 512
        for out_c in (256, 128, 64):
            layers += [nn.Conv2d(c, out_c, 3, padding=1, bias=False), nn.BatchNorm2d(out_c), nn.ReLU(inplace=True),
                       nn.ConvTranspose2d(out_c, out_c, 4, stride=2, padding=1, bias=False),
                       nn.BatchNorm2d(out_c), nn.ReLU(inplace=True)]
            c = out_c
        self.deconv = nn.Sequential(*layers)

        def head(out):
            return nn.Sequential(nn.Conv2d(64, head_conv, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(head_conv, out, 1))

        self.hm, self.wh, self.reg = head(num_classes), head(2), head(2)
        self.hm[-1].bias.data.fill_(-2.19)

    def forward(self, x):
        f = self.deconv(self.backbone(x))
        return self.hm(f), self.wh(f), self.reg(f)


def gather_feat(feat, ind):
    B, C = feat.shape[:2]
    feat = feat.view(B, C, -1).permute(0, 2, 1)
    return feat.gather(1, ind.unsqueeze(2).expand(-1, -1, C))


def focal_loss(pred, gt):
    pred = pred.sigmoid().clamp(1e-4, 1 - 1e-4)
    pos = gt.eq(1).float()
    neg_w = torch.pow(1 - gt, 4)
    pos_loss = (torch.log(pred) * torch.pow(1 - pred, 2) * pos).sum()
    neg_loss = (torch.log(1 - pred) * torch.pow(pred, 2) * neg_w * (1 - pos)).sum()
    return -(pos_loss + neg_loss) / pos.sum().clamp(min=1)


def ctdet_loss(out, batch):
    hm, wh, reg = out
    m = batch["mask"].unsqueeze(2)
    l_hm = focal_loss(hm, batch["hm"])
    l_wh = (F.l1_loss(gather_feat(wh, batch["ind"]) * m, batch["wh"] * m, reduction="sum") / (m.sum() + 1e-4))
    l_off = (F.l1_loss(gather_feat(reg, batch["ind"]) * m, batch["reg"] * m, reduction="sum") / (m.sum() + 1e-4))
    return l_hm + 0.1 * l_wh + l_off, torch.stack([l_hm, l_wh, l_off]).detach()


@torch.no_grad()
def decode(hm, wh, reg, K=100):
    hm = hm.sigmoid()
    keep = (F.max_pool2d(hm, 3, 1, 1) == hm).float()
    hm = hm * keep
    B, C, H, W = hm.shape
    scores, inds = hm.view(B, -1).topk(K)
    cls = inds // (H * W)
    pix = inds % (H * W)
    ys, xs = (pix // W).float(), (pix % W).float()
    off = gather_feat(reg, pix)
    size = gather_feat(wh, pix)
    xs, ys = xs + off[..., 0], ys + off[..., 1]
    boxes = torch.stack([xs - size[..., 0] / 2, ys - size[..., 1] / 2, xs + size[..., 0] / 2, ys + size[..., 1] / 2], -1)
    return boxes * 4, scores, cls


@torch.no_grad()
def evaluate(model, loader, ds, device):
    model.eval()
    results = {}
    for x, _, meta in loader:
        boxes, scores, cls = decode(*model(x.to(device)))
        for b in range(x.shape[0]):
            iid, s, tx, ty = meta[b].tolist()
            bx = boxes[b].cpu().numpy()
            bx[:, [0, 2]] = (bx[:, [0, 2]] - tx) / s
            bx[:, [1, 3]] = (bx[:, [1, 3]] - ty) / s
            bx[:, 2:] -= bx[:, :2]
            results[int(iid)] = [{"image_id": int(iid), "category_id": ds.cat_ids[int(c)], "bbox": bb.tolist(),
                                  "score": float(sc)} for bb, sc, c in zip(bx, scores[b].tolist(), cls[b].tolist())]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() != 0:
        return None
    merged = {k: v for g in gathered for k, v in g.items()}
    E = COCOeval(ds.coco, ds.coco.loadRes([d for v in merged.values() for d in v]), "bbox")
    E.params.imgIds = sorted(merged)
    E.evaluate()
    E.accumulate()
    E.summarize()
    return E.stats[0]


def main():
    args = get_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    device = torch.device("cuda", args.local_rank)
    cv2.setNumThreads(0)

    train_set = CocoCenterNet(args.data, "train", args.input_res, train=True)
    val_set = CocoCenterNet(args.data, "val", args.input_res, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=16, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=args.num_workers)

    model = CenterNet(num_classes=len(train_set.cat_ids))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[args.local_rank], output_device=args.local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=args.lr_step, gamma=0.1)
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)

    for epoch in range(1, args.epochs + 1):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        stats = torch.zeros(3, device=device)
        for it, (x, batch, _) in enumerate(train_loader):
            x = x.to(device, non_blocking=True)
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss, parts = ctdet_loss(model(x), batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            stats += parts
        dist.all_reduce(stats)
        stats /= dist.get_world_size() * len(train_loader)
        scheduler.step()
        if rank == 0:
            print(f"epoch {epoch} | hm {stats[0]:.4f} wh {stats[1]:.4f} off {stats[2]:.4f} | "
                  f"{time.time() - t0:.0f}s", flush=True)
            torch.save({"epoch": epoch, "state_dict": model.module.state_dict(), "optimizer": optimizer.state_dict()},
                       os.path.join(args.save_dir, "model_last.pth"))
        if epoch % 10 == 0:
            ap = evaluate(model.module, val_loader, val_set, device)
            if rank == 0:
                print(f"epoch {epoch} | COCO AP {ap:.4f}", flush=True)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
