"""
SiamMask-style tracker with a mask branch (template/search crops, depth-wise cross-correlation),
trained on YouTube-VOS pairs and evaluated as semi-supervised VOS on DAVIS-2017 val
(the first-frame mask gives the initial box; later boxes come from the predicted masks).

    torchrun --nproc_per_node=8 train_siammask.py --ytvos /data/ytvos/train --davis /data/DAVIS \
        --out snapshot/siammask_r50 [--resume snapshot/siammask_r50/checkpoint_e12.pth]
"""
import argparse
import logging
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
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.ops import FrozenBatchNorm2d, roi_align

logger = logging.getLogger("siammask")
T_SIZE, S_SIZE, CONTEXT = 127, 255, 0.5


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--ytvos", required=True)
    p.add_argument("--davis", required=True)
    p.add_argument("--out", default="snapshot/siammask_r50")
    p.add_argument("--resume", default="")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch", type=int, default=32, help="pairs per GPU")
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--pairs_per_epoch", type=int, default=600000)
    p.add_argument("--workers", type=int, default=10)
    return p.parse_args()


def mask_box(m):
    ys, xs = np.nonzero(m)
    if len(xs) == 0:
        return None
    return np.array([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], np.float32)


def crop_box(box, out_size, jitter=0.0):
    x0, y0, x1, y1 = box
    w, h = x1 - x0, y1 - y0
    cx, cy = (x0 + x1) / 2 + jitter * w * random.uniform(-1, 1), (y0 + y1) / 2 + jitter * h * random.uniform(-1, 1)
    pad = CONTEXT * (w + h)
    s = math.sqrt((w + pad) * (h + pad)) * out_size / T_SIZE
    return np.array([cx - s / 2, cy - s / 2, cx + s / 2, cy + s / 2], np.float32)


def crop(t, box, size):
    """t: C H W tensor, box in pixels -> C size size (zero padded outside the image)."""
    return roi_align(t[None].float(), [torch.as_tensor(box, dtype=torch.float32)[None]], output_size=size, aligned=True)[0]


NORM = torchvision.transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])


class PairDataset(Dataset):
    def __init__(self, root, num_pairs, max_gap=50):
        self.root, self.num_pairs, self.max_gap = root, num_pairs, max_gap
        self.videos = []
        for v in sorted(os.listdir(os.path.join(root, "Annotations"))):
            names = sorted(a[:-4] for a in os.listdir(os.path.join(root, "Annotations", v)))
            if len(names) >= 2:
                self.videos.append((v, names))

    def __len__(self):
        return self.num_pairs

    def __getitem__(self, i):
        for _ in range(10):
            v, names = random.choice(self.videos)
            a = random.randrange(len(names))
            b = min(len(names) - 1, max(0, a + random.randint(-self.max_gap // 5, self.max_gap // 5)))
            ma = np.asarray(Image.open(os.path.join(self.root, "Annotations", v, names[a] + ".png")))
            mb = np.asarray(Image.open(os.path.join(self.root, "Annotations", v, names[b] + ".png")))
            objs = [o for o in np.unique(ma) if o != 0 and (mb == o).sum() > 50]
            if objs:
                break
        o = random.choice(objs) if objs else 1
        ia = NORM(torchvision.transforms.functional.to_tensor(Image.open(os.path.join(self.root, "JPEGImages", v, names[a] + ".jpg")).convert("RGB")))
        ib = NORM(torchvision.transforms.functional.to_tensor(Image.open(os.path.join(self.root, "JPEGImages", v, names[b] + ".jpg")).convert("RGB")))
        ba = mask_box(ma == o)
        bb = mask_box(mb == o)
        if ba is None or bb is None:
            ba = bb = np.array([0, 0, ia.shape[2], ia.shape[1]], np.float32)
        template = crop(ia, crop_box(ba, T_SIZE), T_SIZE)
        sbox = crop_box(bb, S_SIZE, jitter=0.3)
        search = crop(ib, sbox, S_SIZE)
        smask = crop(torch.from_numpy((mb == o).astype(np.float32))[None], sbox, S_SIZE)[0]
        return template, search, (smask > 0.5).float()


class SiamMask(nn.Module):
    def __init__(self):
        super().__init__()
        r = torchvision.models.resnet50(weights="IMAGENET1K_V1", norm_layer=FrozenBatchNorm2d)
        self.features = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool, r.layer1, r.layer2, r.layer3)
        self.adjust = nn.Sequential(nn.Conv2d(1024, 256, 1, bias=False), nn.GroupNorm(32, 256))
        self.kernel = nn.Sequential(nn.Conv2d(256, 256, 3, bias=False), nn.GroupNorm(32, 256), nn.ReLU())
        self.search = nn.Sequential(nn.Conv2d(256, 256, 3, bias=False), nn.GroupNorm(32, 256), nn.ReLU())
        self.mask_head = nn.Sequential(nn.Conv2d(256 + 256, 256, 3, padding=1), nn.GroupNorm(32, 256), nn.ReLU(),
                                       nn.ConvTranspose2d(256, 64, 4, 4), nn.GroupNorm(8, 64), nn.ReLU(),
                                       nn.ConvTranspose2d(64, 32, 2, 2), nn.ReLU(), nn.Conv2d(32, 1, 3, padding=1))

    @staticmethod
    def xcorr_depthwise(x, kernel):
        b, c = kernel.shape[:2]
        out = F.conv2d(x.reshape(1, b * c, *x.shape[2:]), kernel.reshape(b * c, 1, *kernel.shape[2:]), groups=b * c,
                       padding=kernel.shape[-1] // 2)
        return out.reshape(b, c, *out.shape[2:])

    def template_feat(self, z):
        return self.kernel(self.adjust(self.features(z)))

    def track(self, zf, x):
        xf = self.adjust(self.features(x))
        corr = self.xcorr_depthwise(self.search(xf), zf)
        corr = F.interpolate(corr, size=xf.shape[-2:], mode="bilinear", align_corners=False)
        logit = self.mask_head(torch.cat([corr, xf], 1))
        return F.interpolate(logit, size=x.shape[-2:], mode="bilinear", align_corners=False)[:, 0]

    def forward(self, template, search):
        return self.track(self.template_feat(template), search)


def jf(pred, gt):
    u = (pred | gt).sum()
    j = 1.0 if u == 0 else (pred & gt).sum() / u
    t = torch.from_numpy(np.stack([pred, gt]).astype(np.float32))[:, None]
    e = (t + F.max_pool2d(-t, 3, 1, 1)) > 0
    d = F.max_pool2d(e.float(), 9, 1, 4) > 0
    if not e.any():
        return j, 1.0
    p = (e[0] & d[1]).sum().item() / max(e[0].sum().item(), 1)
    r = (e[1] & d[0]).sum().item() / max(e[1].sum().item(), 1)
    return j, 0.0 if p + r == 0 else 2 * p * r / (p + r)


@torch.no_grad()
def eval_davis(net, root, device, rank, world):
    seqs = open(os.path.join(root, "ImageSets/2017/val.txt")).read().split()
    acc = torch.zeros(3, device=device, dtype=torch.float64)
    for seq in seqs[rank::world]:
        names = sorted(os.listdir(os.path.join(root, "JPEGImages/480p", seq)))
        imgs = [NORM(torchvision.transforms.functional.to_tensor(Image.open(os.path.join(root, "JPEGImages/480p", seq, n)).convert("RGB"))).to(device) for n in names]
        gts = [np.asarray(Image.open(os.path.join(root, "Annotations/480p", seq, n[:-4] + ".png"))) for n in names]
        H, W = gts[0].shape
        scores = []
        for o in [o for o in np.unique(gts[0]) if o != 0]:
            box = mask_box(gts[0] == o)
            zf = net.template_feat(crop(imgs[0], crop_box(box, T_SIZE), T_SIZE)[None])
            for t in range(1, len(names)):
                sbox = crop_box(box, S_SIZE)
                prob = torch.sigmoid(net.track(zf, crop(imgs[t], sbox, S_SIZE)[None]))[0]
                # paste the crop prediction back into the frame
                x0, y0, x1, y1 = sbox
                ys = (torch.arange(H, device=device) + 0.5 - y0) / (y1 - y0) * 2 - 1
                xs = (torch.arange(W, device=device) + 0.5 - x0) / (x1 - x0) * 2 - 1
                grid = torch.stack(torch.meshgrid(xs, ys, indexing="xy"), -1)[None]
                full = F.grid_sample(prob[None, None], grid, align_corners=False, padding_mode="zeros")[0, 0]
                pred = (full > 0.5).cpu().numpy()
                scores.append(jf(pred, gts[t] == o))
                nb = mask_box(pred)
                if nb is not None:
                    box = 0.5 * box + 0.5 * nb
        js, fs = zip(*scores)
        acc += torch.tensor([np.mean(js), np.mean(fs), 1.0], device=device, dtype=torch.float64)
    dist.all_reduce(acc)
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    random.seed(rank)
    np.random.seed(rank)

    net = SiamMask()
    opt_state, start_epoch = None, 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        net.load_state_dict(ckpt["state_dict"])
        opt_state, start_epoch = ckpt["optimizer"], ckpt["epoch"] + 1
        logger.info("resumed from %s (epoch %d)", args.resume, ckpt["epoch"])
    # only layer3 of the backbone is fine-tuned
    for p in net.features[:-1].parameters():
        p.requires_grad_(False)
    net.to(device)
    model = DDP(net, device_ids=[local_rank])

    params = [{"params": model.module.features[-1].parameters(), "lr": args.lr * 0.1},
              {"params": [p for n, p in model.module.named_parameters() if not n.startswith("features.")], "lr": args.lr}]
    opt = torch.optim.SGD(params, lr=args.lr, momentum=0.9, weight_decay=1e-4)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: math.exp(math.log(0.05) * e / args.epochs), last_epoch=start_epoch - 1)

    ds = PairDataset(args.ytvos, args.pairs_per_epoch)
    sampler = DistributedSampler(ds, shuffle=True)
    loader = DataLoader(ds, batch_size=args.batch, sampler=sampler, num_workers=args.workers, pin_memory=True, drop_last=True)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for i, (template, search, smask) in enumerate(loader):
            template, search, smask = template.to(device, non_blocking=True), search.to(device, non_blocking=True), smask.to(device, non_blocking=True)
            logit = model(template, search)
            loss = F.binary_cross_entropy_with_logits(logit, smask)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            if i % 100 == 0:
                logger.info("epoch %d [%d/%d] mask loss %.4f", epoch, i, len(loader), loss.item())
        sched.step()

        model.eval()
        j, f = eval_davis(model.module, args.davis, device, rank, world)
        logger.info("epoch %d DAVIS17 val J %.4f F %.4f J&F %.4f", epoch, j, f, (j + f) / 2)
        if rank == 0:
            torch.save({"epoch": epoch, "state_dict": model.state_dict(), "optimizer": opt.state_dict(), "jf": (j + f) / 2},
                       os.path.join(args.out, f"checkpoint_e{epoch}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
