"""Lift-Splat-Shoot BEV vehicle segmentation on nuScenes, DDP.

    torchrun --nproc_per_node=8 train_lss.py --dataroot /data/nuscenes --bsz 4 --nepochs 30
"""
import argparse
import os
import pickle

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

XBOUND = (-50.0, 50.0, 0.5)
YBOUND = (-50.0, 50.0, 0.5)
ZBOUND = (-10.0, 10.0, 20.0)
DBOUND = (4.0, 45.0, 1.0)
FINAL_DIM = (128, 352)
CAMS = ["CAM_FRONT_LEFT", "CAM_FRONT", "CAM_FRONT_RIGHT", "CAM_BACK_LEFT", "CAM_BACK", "CAM_BACK_RIGHT"]
MEAN = torch.tensor([0.485, 0.456, 0.406])[:, None, None]
STD = torch.tensor([0.229, 0.224, 0.225])[:, None, None]


def gen_dx_bx():
    dx = torch.tensor([b[2] for b in (XBOUND, YBOUND, ZBOUND)])
    bx = torch.tensor([b[0] + b[2] / 2.0 for b in (XBOUND, YBOUND, ZBOUND)])
    nx = torch.tensor([int((b[1] - b[0]) / b[2]) for b in (XBOUND, YBOUND, ZBOUND)])
    return dx, bx, nx


class SegmentationData(Dataset):
    """Reads a preprocessed info cache (images, calibration and a rasterised vehicle mask per sample)."""

    def __init__(self, dataroot, split, is_train):
        with open(os.path.join(dataroot, f"lss_infos_{split}.pkl"), "rb") as f:
            self.infos = pickle.load(f)
        self.dataroot, self.is_train = dataroot, is_train

    def __len__(self):
        return len(self.infos)

    def sample_augmentation(self, W, H):
        fH, fW = FINAL_DIM
        if self.is_train:
            resize = np.random.uniform(0.193, 0.225)
            rw, rh = int(W * resize), int(H * resize)
            crop_h = int((1 - np.random.uniform(0.0, 0.22)) * rh) - fH
            crop_w = int(np.random.uniform(0, max(0, rw - fW)))
            flip = np.random.rand() < 0.5
            rot = np.random.uniform(-5.4, 5.4)
        else:
            resize = max(fH / H, fW / W)
            rw, rh = int(W * resize), int(H * resize)
            crop_h, crop_w, flip, rot = int(rh * 0.89) - fH, int(max(0, rw - fW) / 2), False, 0.0
        return resize, (crop_w, crop_h, crop_w + fW, crop_h + fH), flip, rot

    def __getitem__(self, idx):
        info = self.infos[idx]
        imgs, rots, trans, intrins, post_rots, post_trans = [], [], [], [], [], []
        for cam in CAMS:
            c = info["cams"][cam]
            img = Image.open(os.path.join(self.dataroot, c["data_path"]))
            resize, crop, flip, rot = self.sample_augmentation(*img.size)
            img = img.resize((int(img.size[0] * resize), int(img.size[1] * resize))).crop(crop)
            post_rot = torch.eye(2) * resize
            post_tran = -torch.tensor(crop[:2], dtype=torch.float32)
            if flip:
                img = img.transpose(Image.FLIP_LEFT_RIGHT)
                A = torch.tensor([[-1.0, 0.0], [0.0, 1.0]])
                post_rot, post_tran = A @ post_rot, A @ post_tran + torch.tensor([crop[2] - crop[0], 0.0])
            img = img.rotate(rot)
            th = rot / 180 * np.pi
            A = torch.tensor([[np.cos(th), np.sin(th)], [-np.sin(th), np.cos(th)]], dtype=torch.float32)
            b = torch.tensor([crop[2] - crop[0], crop[3] - crop[1]], dtype=torch.float32) / 2
            post_rot, post_tran = A @ post_rot, A @ (post_tran - b) + b
            pr, pt = torch.eye(3), torch.zeros(3)
            pr[:2, :2], pt[:2] = post_rot, post_tran
            imgs.append((torchvision.transforms.functional.to_tensor(img) - MEAN) / STD)
            intrins.append(torch.tensor(c["cam_intrinsic"], dtype=torch.float32))
            rots.append(torch.tensor(c["sensor2ego_rotation"], dtype=torch.float32))
            trans.append(torch.tensor(c["sensor2ego_translation"], dtype=torch.float32))
            post_rots.append(pr)
            post_trans.append(pt)
        binimg = torch.from_numpy(np.load(os.path.join(self.dataroot, info["vehicle_mask"]))).float()[None]
        return (torch.stack(imgs), torch.stack(rots), torch.stack(trans), torch.stack(intrins),
                torch.stack(post_rots), torch.stack(post_trans), binimg)


class CamEncode(nn.Module):
    def __init__(self, D, C):
        super().__init__()
        self.D, self.C = D, C
        r = torchvision.models.resnet34(weights="IMAGENET1K_V1")
        self.trunk = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool, r.layer1, r.layer2, r.layer3)
        self.up = nn.Sequential(nn.Conv2d(256, 256, 3, 1, 1, bias=False), nn.BatchNorm2d(256), nn.ReLU())
        self.depthnet = nn.Conv2d(256, D + C, 1)

    def forward(self, x):
        x = F.interpolate(self.trunk(x), scale_factor=2, mode="bilinear", align_corners=False)
        x = self.depthnet(self.up(x))
        depth = x[:, :self.D].softmax(dim=1)
        return depth.unsqueeze(1) * x[:, self.D:self.D + self.C].unsqueeze(2)


class BevEncode(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        r = torchvision.models.resnet18(weights=None)
        self.conv1 = nn.Conv2d(cin, 64, 7, 2, 3, bias=False)
        self.bn1, self.relu = r.bn1, r.relu
        self.layer1, self.layer2, self.layer3 = r.layer1, r.layer2, r.layer3
        self.up1 = nn.Sequential(nn.Conv2d(64 + 256, 256, 3, 1, 1, bias=False), nn.BatchNorm2d(256), nn.ReLU())
        self.up2 = nn.Sequential(nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True),
                                 nn.Conv2d(256, 128, 3, 1, 1, bias=False), nn.BatchNorm2d(128), nn.ReLU(),
                                 nn.Conv2d(128, cout, 1))

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x1 = self.layer1(x)
        x = self.layer3(self.layer2(x1))
        x = F.interpolate(x, scale_factor=4, mode="bilinear", align_corners=True)
        return self.up2(self.up1(torch.cat([x1, x], 1)))


class LiftSplatShoot(nn.Module):
    def __init__(self, outC=1, camC=64, downsample=16):
        super().__init__()
        dx, bx, nx = gen_dx_bx()
        self.register_buffer("dx", dx, persistent=False)
        self.register_buffer("bx", bx, persistent=False)
        self.nx = nx.tolist()
        self.downsample, self.camC = downsample, camC
        self.register_buffer("frustum", self.create_frustum(), persistent=False)
        self.D = self.frustum.shape[0]
        self.camencode = CamEncode(self.D, camC)
        self.bevencode = BevEncode(camC, outC)

    def create_frustum(self):
        ogfH, ogfW = FINAL_DIM
        fH, fW = ogfH // self.downsample, ogfW // self.downsample
        ds = torch.arange(*DBOUND, dtype=torch.float).view(-1, 1, 1).expand(-1, fH, fW)
        D = ds.shape[0]
        xs = torch.linspace(0, ogfW - 1, fW).view(1, 1, fW).expand(D, fH, fW)
        ys = torch.linspace(0, ogfH - 1, fH).view(1, fH, 1).expand(D, fH, fW)
        return torch.stack((xs, ys, ds), -1)

    def get_geometry(self, rots, trans, intrins, post_rots, post_trans):
        B, N, _ = trans.shape
        pts = self.frustum - post_trans.view(B, N, 1, 1, 1, 3)
        pts = torch.inverse(post_rots).view(B, N, 1, 1, 1, 3, 3).matmul(pts.unsqueeze(-1))
        pts = torch.cat((pts[:, :, :, :, :, :2] * pts[:, :, :, :, :, 2:3], pts[:, :, :, :, :, 2:3]), 5)
        combine = rots.matmul(torch.inverse(intrins))
        pts = combine.view(B, N, 1, 1, 1, 3, 3).matmul(pts).squeeze(-1)
        return pts + trans.view(B, N, 1, 1, 1, 3)

    def voxel_pooling(self, geom, x):
        B, N, D, H, W, C = x.shape
        Nprime = B * N * D * H * W
        x = x.reshape(Nprime, C)
        geom = ((geom - (self.bx - self.dx / 2.0)) / self.dx).long().view(Nprime, 3)
        batch_ix = torch.arange(B, device=x.device).repeat_interleave(Nprime // B)[:, None]
        geom = torch.cat((geom, batch_ix), 1)
        kept = ((geom[:, 0] >= 0) & (geom[:, 0] < self.nx[0]) & (geom[:, 1] >= 0) & (geom[:, 1] < self.nx[1])
                & (geom[:, 2] >= 0) & (geom[:, 2] < self.nx[2]))
        x, geom = x[kept], geom[kept]
        ranks = (geom[:, 0] * (self.nx[1] * self.nx[2] * B) + geom[:, 1] * (self.nx[2] * B)
                 + geom[:, 2] * B + geom[:, 3])
        order = ranks.argsort()
        x, geom, ranks = x[order], geom[order], ranks[order]
        x = x.cumsum(0)
        keep = torch.ones(x.shape[0], device=x.device, dtype=torch.bool)
        keep[:-1] = ranks[1:] != ranks[:-1]
        x, geom = x[keep], geom[keep]
        x = torch.cat((x[:1], x[1:] - x[:-1]))
        final = torch.zeros((B, C, self.nx[2], self.nx[0], self.nx[1]), device=x.device, dtype=x.dtype)
        final[geom[:, 3], :, geom[:, 2], geom[:, 0], geom[:, 1]] = x
        return torch.cat(final.unbind(dim=2), 1)

    def forward(self, x, rots, trans, intrins, post_rots, post_trans):
        geom = self.get_geometry(rots, trans, intrins, post_rots, post_trans)
        B, N, C, imH, imW = x.shape
        feats = self.camencode(x.view(B * N, C, imH, imW))
        feats = feats.view(B, N, self.camC, self.D, imH // self.downsample, imW // self.downsample)
        feats = feats.permute(0, 1, 3, 4, 5, 2)
        return self.bevencode(self.voxel_pooling(geom, feats))


@torch.no_grad()
def eval_iou(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device, dtype=torch.float64)  # intersect, union, loss
    n = torch.zeros(1, device=device, dtype=torch.float64)
    loss_fn = nn.BCEWithLogitsLoss(pos_weight=torch.tensor([2.13], device=device))
    for batch in loader:
        *inputs, binimgs = [t.to(device, non_blocking=True) for t in batch]
        preds = model(*inputs)
        stats[2] += loss_fn(preds, binimgs).item() * preds.shape[0]
        n += preds.shape[0]
        p = preds > 0
        tgt = binimgs > 0.5
        stats[0] += (p & tgt).sum()
        stats[1] += (p | tgt).sum()
    dist.all_reduce(stats)
    dist.all_reduce(n)
    model.train()
    return (stats[0] / stats[1]).item(), (stats[2] / n).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataroot", default="/data/nuscenes")
    ap.add_argument("--logdir", default="./runs/lss")
    ap.add_argument("--nepochs", type=int, default=30)
    ap.add_argument("--bsz", type=int, default=4)
    ap.add_argument("--nworkers", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight_decay", type=float, default=1e-7)
    ap.add_argument("--max_grad_norm", type=float, default=5.0)
    ap.add_argument("--pos_weight", type=float, default=2.13)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(42)

    trainset = SegmentationData(args.dataroot, "train", True)
    valset = SegmentationData(args.dataroot, "val", False)
    tsampler = DistributedSampler(trainset, shuffle=True)
    trainloader = DataLoader(trainset, batch_size=args.bsz, sampler=tsampler, num_workers=args.nworkers,
                             drop_last=True, pin_memory=True)
    val_shard = torch.utils.data.Subset(valset, range(rank, len(valset), world))
    valloader = DataLoader(val_shard, batch_size=args.bsz, shuffle=False, num_workers=args.nworkers)

    model = LiftSplatShoot(outC=1).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    # pretrained image trunk gets a smaller lr than the randomly initialised parts
    trunk_params = list(model.camencode.trunk.parameters())
    trunk_ids = {id(p) for p in trunk_params}
    other_params = [p for p in model.parameters() if id(p) not in trunk_ids]
    opt = torch.optim.Adam([{"params": trunk_params, "lr": args.lr * 0.1},
                            {"params": other_params, "lr": args.lr}], weight_decay=args.weight_decay)
    loss_fn = nn.BCEWithLogitsLoss(pos_weight=torch.tensor([args.pos_weight], device=device))

    best_iou = 0.0
    os.makedirs(args.logdir, exist_ok=True)
    for epoch in range(args.nepochs):
        tsampler.set_epoch(epoch)
        model.train()
        for it, batch in enumerate(trainloader):
            imgs, rots, trans, intrins, post_rots, post_trans, binimgs = [t.to(device, non_blocking=True)
                                                                          for t in batch]
            preds = model(imgs, rots, trans, intrins, post_rots, post_trans)
            loss = loss_fn(preds, binimgs)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            opt.step()
            if rank == 0 and it % 20 == 0:
                print(f"ep {epoch} it {it}/{len(trainloader)} loss {loss.item():.4f}", flush=True)

        iou, vloss = eval_iou(model.module, valloader, device)
        if rank == 0:
            print(f"epoch {epoch}: val IoU {iou:.4f} val loss {vloss:.4f}", flush=True)
            state = {"net": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch, "iou": iou}
            torch.save(state, os.path.join(args.logdir, "last.pt"))
            if iou > best_iou:
                best_iou = iou
                torch.save(state, os.path.join(args.logdir, "best.pt"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
