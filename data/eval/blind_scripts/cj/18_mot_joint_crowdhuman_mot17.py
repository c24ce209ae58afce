"""Joint detection-and-embedding tracker (CenterNet heads + 128-d re-ID head), CrowdHuman + MOT17.

CrowdHuman frames carry no identities (id column is -1); they only train the detection heads.

torchrun --nproc_per_node=8 18_mot_joint_crowdhuman_mot17.py --root /data/mot_mix --out exp/jde_mix
"""
import argparse
import math
import os
import os.path as osp
from dataclasses import dataclass

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


@dataclass
class Config:
    root: str = "/data/mot_mix"
    out: str = "exp/jde_mix"
    width: int = 1088
    height: int = 608
    batch_per_gpu: int = 8
    lr: float = 1e-4          # Adam, for a global batch of 64
    epochs: int = 30
    emb_dim: int = 128
    max_objs: int = 500
    resume: bool = False


def get_config():
    ap = argparse.ArgumentParser()
    for name, field in Config.__dataclass_fields__.items():
        if field.type is bool:
            ap.add_argument(f"--{name.replace('_', '-')}", action="store_true")
        else:
            ap.add_argument(f"--{name.replace('_', '-')}", type=field.type, default=field.default)
    return Config(**vars(ap.parse_args()))


class LabeledFrames(Dataset):
    """Frames listed in <root>/<name>.txt; labels in labels_with_ids as 'cls id cx cy w h' (normalised)."""

    def __init__(self, cfg, name, id_offset, train=True):
        with open(osp.join(cfg.root, f"{name}.txt")) as f:
            self.images = [osp.join(cfg.root, l.strip()) for l in f if l.strip()]
        self.cfg, self.id_offset, self.train = cfg, id_offset, train
        self.num_ids = 0
        for p in self.images:
            lab = self._labels(p)
            if len(lab):
                self.num_ids = max(self.num_ids, int(lab[:, 1].max()) + 1)

    @staticmethod
    def _labels(img_path):
        lp = img_path.replace("images", "labels_with_ids").rsplit(".", 1)[0] + ".txt"
        return np.loadtxt(lp, dtype=np.float32, ndmin=2).reshape(-1, 6) if osp.exists(lp) else np.zeros((0, 6), np.float32)

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        c = self.cfg
        img = cv2.resize(cv2.imread(self.images[i]), (c.width, c.height))
        lab = self._labels(self.images[i]).copy()
        if self.train and np.random.rand() < 0.5:
            img, lab[:, 2] = img[:, ::-1], 1 - lab[:, 2]
        ow, oh = c.width // 4, c.height // 4
        hm = np.zeros((1, oh, ow), np.float32)
        size = np.zeros((c.max_objs, 2), np.float32)
        off = np.zeros((c.max_objs, 2), np.float32)
        ind = np.zeros(c.max_objs, np.int64)
        mask = np.zeros(c.max_objs, np.float32)
        ids = -np.ones(c.max_objs, np.int64)
        ys, xs = np.mgrid[0:oh, 0:ow]
        for k, (_, tid, cx, cy, w, h) in enumerate(lab[:c.max_objs]):
            cx, cy, w, h = cx * ow, cy * oh, w * ow, h * oh
            ix, iy = int(cx), int(cy)
            if w < 1 or h < 1 or not (0 <= ix < ow and 0 <= iy < oh):
                continue
            sigma = max(0.5, 0.08 * math.sqrt(w * h))
            hm[0] = np.maximum(hm[0], np.exp(-((xs - ix) ** 2 + (ys - iy) ** 2) / (2 * sigma ** 2)))
            size[k], off[k], ind[k], mask[k] = (w, h), (cx - ix, cy - iy), iy * ow + ix, 1
            if tid >= 0:
                ids[k] = int(tid) + self.id_offset
        img = torch.from_numpy(np.ascontiguousarray(img[:, :, ::-1].transpose(2, 0, 1))).float().div_(255)
        return img, torch.from_numpy(hm), dict(size=size, off=off, ind=ind, mask=mask, ids=ids)


class JDENet(nn.Module):
    def __init__(self, num_ids, emb_dim):
        super().__init__()
        r = torchvision.models.resnet50(weights="IMAGENET1K_V2")
        self.c2 = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool, r.layer1)
        self.c3, self.c4, self.c5 = r.layer2, r.layer3, r.layer4
        self.up = nn.ModuleList([nn.Conv2d(c, 128, 1) for c in (256, 512, 1024, 2048)])
        self.fuse = nn.Sequential(nn.Conv2d(128, 128, 3, padding=1, bias=False), nn.BatchNorm2d(128), nn.ReLU(True))
        mk = lambda o: nn.Sequential(nn.Conv2d(128, 256, 3, padding=1), nn.ReLU(True), nn.Conv2d(256, o, 1))
        self.heads = nn.ModuleDict({"hm": mk(1), "size": mk(2), "off": mk(2), "emb": mk(emb_dim)})
        nn.init.constant_(self.heads["hm"][-1].bias, -2.19)
        self.classifier = nn.Linear(emb_dim, num_ids)

    def forward(self, x):
        c2 = self.c2(x)
        c3 = self.c3(c2)
        c4 = self.c4(c3)
        c5 = self.c5(c4)
        y = self.up[3](c5)
        for lat, f in ((self.up[2], c4), (self.up[1], c3), (self.up[0], c2)):
            y = F.interpolate(y, size=f.shape[-2:], mode="nearest") + lat(f)
        y = self.fuse(y)
        return {k: h(y) for k, h in self.heads.items()}


def pick(fmap, ind):
    c = fmap.size(1)
    return fmap.flatten(2).transpose(1, 2).gather(1, ind.unsqueeze(-1).expand(-1, -1, c))


def joint_loss(core, out, hm_gt, t, num_ids):
    p = out["hm"].float().sigmoid().clamp(1e-4, 1 - 1e-4)
    pos = hm_gt.eq(1).float()
    focal = -(torch.log(p) * (1 - p) ** 2 * pos + torch.log(1 - p) * p ** 2 * (1 - hm_gt) ** 4 * (1 - pos)).sum()
    focal = focal / pos.sum().clamp(min=1)
    m = t["mask"].unsqueeze(-1)
    l_size = (pick(out["size"].float(), t["ind"]) - t["size"]).abs().mul(m).sum() / m.sum().clamp(min=1)
    l_off = (pick(out["off"].float(), t["ind"]) - t["off"]).abs().mul(m).sum() / m.sum().clamp(min=1)

    with_id = (t["mask"] > 0) & (t["ids"] >= 0)
    emb = pick(out["emb"].float(), t["ind"])
    if with_id.any():
        e = math.sqrt(2) * math.log(num_ids - 1) * F.normalize(emb[with_id], dim=1)
        l_id = F.cross_entropy(core.classifier(e), t["ids"][with_id])
    else:
        # detection-only batch (CrowdHuman): zero-weighted term keeps the re-ID head and classifier in the graph
        l_id = (emb.sum() + core.classifier.weight.sum() + core.classifier.bias.sum()) * 0.0
    loss = focal + 0.1 * l_size + l_off + l_id
    return loss, torch.stack([focal, l_size, l_off, l_id]).detach()


def main():
    cfg = get_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    ch = LabeledFrames(cfg, "crowdhuman.train", id_offset=0)
    mot = LabeledFrames(cfg, "mot17.train", id_offset=0)
    num_ids = mot.num_ids
    train_set = ConcatDataset([ch, mot])
    val_set = LabeledFrames(cfg, "mot17.val", id_offset=0, train=False)
    sampler = DistributedSampler(train_set, shuffle=True, seed=17)
    loader = DataLoader(train_set, batch_size=cfg.batch_per_gpu, sampler=sampler, num_workers=8, pin_memory=True,
                        drop_last=True, persistent_workers=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=cfg.batch_per_gpu,
                            num_workers=4)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(JDENet(num_ids, cfg.emb_dim)).to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = cfg.lr * cfg.batch_per_gpu * world / 64
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [20, 27], 0.1)

    start = 0
    ckpt_path = osp.join(cfg.out, "last.pth")
    if cfg.resume and osp.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location={"cuda:0": f"cuda:{local_rank}"})
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start = ckpt["epoch"]

    run = None
    if rank == 0:
        os.makedirs(cfg.out, exist_ok=True)
        run = wandb.init(project="jde-mix", config=vars(cfg), dir=cfg.out, resume="allow")

    for epoch in range(start, cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for step, (img, hm_gt, t) in enumerate(loader):
            img, hm_gt = img.to(device, non_blocking=True), hm_gt.to(device, non_blocking=True)
            t = {k: v.to(device, non_blocking=True) for k, v in t.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(img)
            loss, parts = joint_loss(model.module, out, hm_gt, t, num_ids)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            optimizer.step()
            if step % 50 == 0:
                dist.all_reduce(parts, op=dist.ReduceOp.AVG)
                if run is not None:
                    run.log({"loss/hm": parts[0].item(), "loss/size": parts[1].item(), "loss/off": parts[2].item(),
                             "loss/id": parts[3].item(), "lr": optimizer.param_groups[0]["lr"],
                             "epoch": epoch + step / len(loader)})
        scheduler.step()

        model.eval()
        acc = torch.zeros(3, device=device)
        with torch.no_grad():
            for img, hm_gt, t in val_loader:
                img, hm_gt = img.to(device), hm_gt.to(device)
                t = {k: v.to(device) for k, v in t.items()}
                t["ids"] = torch.full_like(t["ids"], -1)  # val ids are not in the training label space
                _, parts = joint_loss(model.module, model.module(img), hm_gt, t, num_ids)
                acc += torch.stack([parts[0], parts[1], torch.ones((), device=device)])
        dist.all_reduce(acc)
        if rank == 0:
            run.log({"val/hm": (acc[0] / acc[2]).item(), "val/size": (acc[1] / acc[2]).item(), "epoch": epoch + 1})
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch + 1}
            torch.save(state, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier(device_ids=[local_rank])

    if run is not None:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
