"""Multi-task urban change detection on 0.3 m aerial orthophoto pairs.

Main task: binary building/land-use change.  Auxiliary task: 9-class land-use
segmentation of each date (labels from the municipal cadastre), switched on
after a few epochs once the change head has settled.

    torchrun --nproc_per_node=4 14_multitask_change_aux_seg.py
"""
import json
import os
import random
import time

import cv2
import numpy as np
import segmentation_models_pytorch as smp
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

CFG = dict(
    root="/data/ortho_cd",
    out="runs/mtcd_effb3",
    encoder="efficientnet-b3",
    encoder_ckpt="/data/weights/efficientnet-b3-imagenet.pth",
    n_landuse=9,
    crop=512,
    epochs=60,
    batch_size=6,            # per GPU
    lr=3e-4,                 # for 4 GPUs x 6
    aux_start_epoch=5,
    aux_weight=0.5,
    workers=8,
    seed=2024,
)


class OrthoPairs(Dataset):
    def __init__(self, root, split, crop, train):
        with open(os.path.join(root, f"{split}.json")) as f:
            self.items = json.load(f)   # [{"t1":..., "t2":..., "cd":..., "lu1":..., "lu2":...}, ...]
        self.root, self.crop, self.train = root, crop, train

    def __len__(self):
        return len(self.items)

    def _img(self, rel):
        im = cv2.imread(os.path.join(self.root, rel), cv2.IMREAD_COLOR)
        return cv2.cvtColor(im, cv2.COLOR_BGR2RGB)

    def _lab(self, rel):
        return cv2.imread(os.path.join(self.root, rel), cv2.IMREAD_GRAYSCALE)

    def __getitem__(self, i):
        it = self.items[i]
        a, b = self._img(it["t1"]), self._img(it["t2"])
        cd, lu1, lu2 = self._lab(it["cd"]), self._lab(it["lu1"]), self._lab(it["lu2"])
        if self.train:
            h, w = cd.shape
            r, c = random.randint(0, h - self.crop), random.randint(0, w - self.crop)
            sl = (slice(r, r + self.crop), slice(c, c + self.crop))
            a, b, cd, lu1, lu2 = a[sl], b[sl], cd[sl], lu1[sl], lu2[sl]
            if random.random() < 0.5:
                a, b, cd, lu1, lu2 = [np.fliplr(v) for v in (a, b, cd, lu1, lu2)]
            if random.random() < 0.3:  # radiometric jitter on one date only
                b = np.clip(b.astype(np.float32) * random.uniform(0.8, 1.2), 0, 255).astype(np.uint8)
        x = np.concatenate([a, b], 2).astype(np.float32).transpose(2, 0, 1) / 255.0
        to = lambda v: torch.from_numpy(np.ascontiguousarray(v))
        return to(x), to((cd > 0).astype(np.int64)), to(lu1.astype(np.int64)), to(lu2.astype(np.int64))


class MultiTaskCD(nn.Module):
    def __init__(self, encoder, n_landuse, encoder_ckpt=None):
        super().__init__()
        base = smp.Unet(encoder, encoder_weights=None, in_channels=3, classes=n_landuse)
        if encoder_ckpt:
            base.encoder.load_state_dict(torch.load(encoder_ckpt, map_location="cpu"))
        self.encoder = base.encoder
        self.seg_decoder = base.decoder
        self.seg_head = base.segmentation_head
        self.cd_decoder = smp.Unet(encoder, encoder_weights=None, in_channels=3, classes=2).decoder
        # level 0 is the raw input, which the smp decoders skip
        self.diff_convs = nn.ModuleList([nn.Conv2d(2 * c, c, 1) for c in self.encoder.out_channels[1:]])
        self.cd_head = nn.Conv2d(16, 2, 3, padding=1)

    def forward(self, x):
        f1, f2 = self.encoder(x[:, :3]), self.encoder(x[:, 3:])
        fused = [f1[0]] + [conv(torch.cat([a, b], 1)) for conv, a, b in zip(self.diff_convs, f1[1:], f2[1:])]
        change = self.cd_head(self.cd_decoder(*fused))
        seg1 = self.seg_head(self.seg_decoder(*f1))
        seg2 = self.seg_head(self.seg_decoder(*f2))
        return {"change": change, "seg1": seg1, "seg2": seg2}


@torch.no_grad()
def validate(net, loader, device):
    net.eval()
    st = torch.zeros(3, device=device, dtype=torch.float64)
    for x, cd, _, _ in loader:
        x, cd = x.to(device), cd.to(device)
        p = net(x)["change"].argmax(1) == 1
        t = cd == 1
        st += torch.stack([(p & t).sum(), (p & ~t).sum(), (~p & t).sum()]).double()
    dist.all_reduce(st)
    tp, fp, fn = st.tolist()
    return 2 * tp / max(1.0, 2 * tp + fp + fn)


def main(cfg):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg["seed"])

    train_ds = OrthoPairs(cfg["root"], "train", cfg["crop"], train=True)
    val_ds = OrthoPairs(cfg["root"], "val", cfg["crop"], train=False)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg["seed"])
    train_dl = DataLoader(train_ds, cfg["batch_size"], sampler=sampler, num_workers=cfg["workers"],
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)), 2,
                        num_workers=cfg["workers"], pin_memory=True)

    net = MultiTaskCD(cfg["encoder"], cfg["n_landuse"], cfg["encoder_ckpt"])
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])
    lr = cfg["lr"] * world * cfg["batch_size"] / 24
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg["epochs"], eta_min=1e-6)
    cd_w = torch.tensor([1.0, 4.0], device=device)

    if rank == 0:
        os.makedirs(cfg["out"], exist_ok=True)
        with open(os.path.join(cfg["out"], "config.json"), "w") as f:
            json.dump({**cfg, "world_size": world, "lr_scaled": lr}, f, indent=2)

    best = 0.0
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        use_aux = epoch >= cfg["aux_start_epoch"]
        t0 = time.time()
        for step, (x, cd, lu1, lu2) in enumerate(train_dl):
            x, cd = x.to(device, non_blocking=True), cd.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(x)
            loss = F.cross_entropy(out["change"].float(), cd, weight=cd_w)
            if use_aux:
                lu1, lu2 = lu1.to(device, non_blocking=True), lu2.to(device, non_blocking=True)
                aux = (F.cross_entropy(out["seg1"].float(), lu1, ignore_index=255)
                       + F.cross_entropy(out["seg2"].float(), lu2, ignore_index=255)) / 2
                loss = loss + cfg["aux_weight"] * aux
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if rank == 0 and step % 50 == 0:
                print(f"ep {epoch} step {step} loss {loss.item():.4f} aux={'on' if use_aux else 'off'}", flush=True)
        sched.step()

        f1 = validate(net, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch} change F1 {f1:.4f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(cfg["out"], "last.pt"))
            if f1 > best:
                best = f1
                torch.save({"model": net.state_dict(), "epoch": epoch, "f1": f1},
                           os.path.join(cfg["out"], "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main(CFG)
