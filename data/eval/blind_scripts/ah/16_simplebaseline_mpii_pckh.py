"""SimpleBaseline (ResNet-50 + deconv) on MPII, 16 joints, PCKh@0.5.

torchrun --nproc_per_node=4 tools/train_mpii.py --cfg experiments/mpii/res50_256x256_d256x3_adam_lr1e-3.yaml
"""
import argparse
import json
import logging
import os

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

NUM_JOINTS = 16
FLIP_PAIRS = [[0, 5], [1, 4], [2, 3], [10, 15], [11, 14], [12, 13]]
HEAD_TOP, UPPER_NECK = 9, 8
logger = logging.getLogger(__name__)


def get_affine(center, scale, rot, out_size, inv=False):
    src_w = scale * 200.0
    rad = np.pi * rot / 180
    sn, cs = np.sin(rad), np.cos(rad)
    src_dir = np.array([-src_w * 0.5 * sn, src_w * -0.5 * cs])
    dst_dir = np.array([0, out_size[0] * -0.5])
    src = np.zeros((3, 2), np.float32)
    dst = np.zeros((3, 2), np.float32)
    src[0], src[1] = center, center + src_dir
    dst[0] = [out_size[0] * 0.5, out_size[1] * 0.5]
    dst[1] = dst[0] + dst_dir
    src[2] = src[1] + np.array([-(src[0] - src[1])[1], (src[0] - src[1])[0]])
    dst[2] = dst[1] + np.array([-(dst[0] - dst[1])[1], (dst[0] - dst[1])[0]])
    return cv2.getAffineTransform(dst, src) if inv else cv2.getAffineTransform(src, dst)


class MPIIDataset(Dataset):
    def __init__(self, root, image_set, is_train, image_size=256, heatmap_size=64, sigma=2):
        with open(os.path.join(root, "annot", f"{image_set}.json")) as f:
            self.db = json.load(f)
        self.root, self.is_train = root, is_train
        self.image_size, self.heatmap_size, self.sigma = image_size, heatmap_size, sigma
        self.tf = torchvision.transforms.Compose([torchvision.transforms.ToTensor(),
                                                  torchvision.transforms.Normalize([0.485, 0.456, 0.406],
                                                                                   [0.229, 0.224, 0.225])])

    def __len__(self):
        return len(self.db)

    def __getitem__(self, idx):
        a = self.db[idx]
        img = cv2.imread(os.path.join(self.root, "images", a["image"]), cv2.IMREAD_COLOR | cv2.IMREAD_IGNORE_ORIENTATION)
        img = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
        c = np.array(a["center"], np.float32)
        s = a["scale"] * 1.25
        c[1] += 15 * a["scale"]
        joints = np.array(a["joints"], np.float32)
        vis = np.array(a["joints_vis"], np.float32)
        r = 0.0
        if self.is_train:
            s *= np.clip(np.random.randn() * 0.25 + 1, 0.75, 1.25)
            r = np.clip(np.random.randn() * 30, -60, 60) if np.random.rand() <= 0.6 else 0.0
            if np.random.rand() <= 0.5:
                img = img[:, ::-1]
                joints[:, 0] = img.shape[1] - joints[:, 0] - 1
                c[0] = img.shape[1] - c[0] - 1
                for p, q in FLIP_PAIRS:
                    joints[[p, q]] = joints[[q, p]]
                    vis[[p, q]] = vis[[q, p]]
        T = get_affine(c, s, r, (self.image_size, self.image_size))
        inp = cv2.warpAffine(np.ascontiguousarray(img), T, (self.image_size, self.image_size), flags=cv2.INTER_LINEAR)
        j = np.concatenate([joints, np.ones((NUM_JOINTS, 1), np.float32)], 1) @ T.T
        stride = self.image_size / self.heatmap_size
        target = np.zeros((NUM_JOINTS, self.heatmap_size, self.heatmap_size), np.float32)
        weight = vis.copy()
        xs, ys = np.arange(self.heatmap_size)[None], np.arange(self.heatmap_size)[:, None]
        for k in range(NUM_JOINTS):
            mx, my = j[k] / stride
            if vis[k] > 0 and 0 <= mx < self.heatmap_size and 0 <= my < self.heatmap_size:
                target[k] = np.exp(-((xs - mx) ** 2 + (ys - my) ** 2) / (2 * self.sigma ** 2))
            else:
                weight[k] = 0
        meta = {"center": c, "scale": np.float32(s), "joints": np.array(a["joints"], np.float32),
                "vis": np.array(a["joints_vis"], np.float32), "index": idx}
        return self.tf(inp), torch.from_numpy(target), torch.from_numpy(weight), meta


class PoseResNet(nn.Module):
    def __init__(self, num_joints=NUM_JOINTS):
        super().__init__()
        r = torchvision.models.resnet50(weights="IMAGENET1K_V1")
        self.backbone = nn.Sequential(*list(r.children())[:-2])
        layers, cin = [], 2048
        for _ in range(3):
            layers += [nn.ConvTranspose2d(cin, 256, 4, 2, 1, bias=False), nn.BatchNorm2d(256), nn.ReLU(True)]
            cin = 256
        self.deconv = nn.Sequential(*layers)
        self.final = nn.Conv2d(256, num_joints, 1)
        for m in self.deconv.modules():
            if isinstance(m, nn.ConvTranspose2d):
                nn.init.normal_(m.weight, std=0.001)
        nn.init.normal_(self.final.weight, std=0.001)
        nn.init.zeros_(self.final.bias)

    def forward(self, x):
        return self.final(self.deconv(self.backbone(x)))


class JointsMSELoss(nn.Module):
    def forward(self, out, tgt, w):
        return 0.5 * (((out - tgt) ** 2).mean((2, 3)) * w ** 2).mean() * NUM_JOINTS


def get_final_preds(hm, center, scale):
    B, K, H, W = hm.shape
    flat = hm.reshape(B, K, -1)
    idx = flat.argmax(-1)
    coords = np.stack([idx % W, idx // W], -1).astype(np.float32)
    for b in range(B):
        for k in range(K):
            px, py = int(coords[b, k, 0]), int(coords[b, k, 1])
            if 1 < px < W - 1 and 1 < py < H - 1:
                diff = np.array([hm[b, k, py, px + 1] - hm[b, k, py, px - 1], hm[b, k, py + 1, px] - hm[b, k, py - 1, px]])
                coords[b, k] += np.sign(diff) * 0.25
    out = np.zeros_like(coords)
    for b in range(B):
        T = get_affine(center[b], scale[b], 0, (W, H), inv=True)
        out[b] = np.concatenate([coords[b], np.ones((K, 1))], 1) @ T.T
    return out


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    hits, total = np.zeros(NUM_JOINTS), np.zeros(NUM_JOINTS)
    for inp, _, _, meta in loader:
        inp = inp.to(device, non_blocking=True)
        out = model(inp)
        flipped = torch.flip(model(torch.flip(inp, [3])), [3])
        for p, q in FLIP_PAIRS:
            flipped[:, [p, q]] = flipped[:, [q, p]]
        flipped[:, :, :, 1:] = flipped.clone()[:, :, :, :-1]
        hm = (0.5 * (out + flipped)).cpu().numpy()
        preds = get_final_preds(hm, meta["center"].numpy(), meta["scale"].numpy())
        gt, vis = meta["joints"].numpy(), meta["vis"].numpy()
        headsize = np.linalg.norm(gt[:, HEAD_TOP] - gt[:, UPPER_NECK], axis=-1) * 0.6
        dist_norm = np.linalg.norm(preds - gt, axis=-1) / np.maximum(headsize[:, None], 1e-6)
        hits += ((dist_norm <= 0.5) & (vis > 0)).sum(0)
        total += (vis > 0).sum(0)
    stats = torch.from_numpy(np.stack([hits, total]))
    dist.all_reduce(stats)
    hits, total = stats[0].numpy(), stats[1].numpy()
    pckh = hits / np.maximum(total, 1)
    model.train()
    return pckh, hits.sum() / max(total.sum(), 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    args = ap.parse_args()
    cfg = yaml.safe_load(open(args.cfg))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(format="%(asctime)-15s %(message)s", level=logging.INFO if rank == 0 else logging.WARNING)
    torch.manual_seed(cfg.get("seed", 0))
    np.random.seed(cfg.get("seed", 0) + rank)

    train_ds = MPIIDataset(cfg["data_root"], "train", True)
    valid_ds = MPIIDataset(cfg["data_root"], "valid", False)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=cfg["batch_size_per_gpu"], sampler=train_sampler,
                              num_workers=cfg["workers"], pin_memory=True, drop_last=True)
    valid_loader = DataLoader(torch.utils.data.Subset(valid_ds, range(rank, len(valid_ds), world_size)),
                              batch_size=cfg["batch_size_per_gpu"], num_workers=cfg["workers"], pin_memory=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(PoseResNet()).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    criterion = JointsMSELoss()
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, cfg["lr_step"], cfg["lr_factor"])

    out_dir = cfg["output_dir"]
    best, begin_epoch = 0.0, 0
    ckpt_file = os.path.join(out_dir, "checkpoint.pth")
    if cfg.get("auto_resume") and os.path.exists(ckpt_file):
        ck = torch.load(ckpt_file, map_location="cpu")
        model.module.load_state_dict(ck["state_dict"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        begin_epoch, best = ck["epoch"], ck["perf"]

    for epoch in range(begin_epoch, cfg["end_epoch"]):
        train_sampler.set_epoch(epoch)
        model.train()
        for i, (inp, target, weight, _) in enumerate(train_loader):
            inp = inp.to(device, non_blocking=True)
            target, weight = target.to(device, non_blocking=True), weight.to(device, non_blocking=True)
            loss = criterion(model(inp), target, weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if i % cfg["print_freq"] == 0:
                logger.info("Epoch: [%d][%d/%d] Loss %.6f", epoch, i, len(train_loader), loss.item())
        scheduler.step()

        pckh, mean = validate(model.module, valid_loader, device)
        if rank == 0:
            names = ["rank", "rkne", "rhip", "lhip", "lkne", "lank", "pelv", "thor", "neck", "head", "rwri",
                     "relb", "rsho", "lsho", "lelb", "lwri"]
            logger.info("PCKh@0.5 mean %.4f | %s", mean, " ".join(f"{n} {v:.3f}" for n, v in zip(names, pckh)))
            is_best = mean > best
            best = max(best, mean)
            os.makedirs(out_dir, exist_ok=True)
            torch.save({"epoch": epoch + 1, "state_dict": model.module.state_dict(), "perf": best,
                        "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, ckpt_file)
            if is_best:
                torch.save(model.module.state_dict(), os.path.join(out_dir, "model_best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
