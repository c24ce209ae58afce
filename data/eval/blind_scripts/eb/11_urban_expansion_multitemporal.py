"""Urban expansion mapping from three annual Sentinel-2 median composites.

Classes: 0 = non-urban, 1 = urban in all years, 2 = new urban (expansion).
Chips (zarr) are stored per metro area; metros are split train/val by country
so the model is validated on unseen building styles.

    torchrun --nproc_per_node=8 11_urban_expansion_multitemporal.py --config configs/urban_exp.yaml
"""
import argparse
import datetime
import os

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
import zarr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

N_DATES, N_BANDS, N_CLASSES = 3, 10, 3
CLASS_NAMES = ("non_urban", "stable_urban", "new_urban")


# ----------------------------------------------------------------------------- utils
def is_dist():
    return dist.is_available() and dist.is_initialized()


def all_reduce_sum(t):
    if is_dist():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def miou_from_confusion(conf):
    inter = conf.diag()
    union = conf.sum(0) + conf.sum(1) - inter
    iou = inter / union.clamp(min=1)
    return iou.mean().item(), iou.tolist()


# ----------------------------------------------------------------------------- data
class MetroChips(Dataset):
    def __init__(self, store, metros, mean, std, train):
        self.root = zarr.open(store, mode="r")
        self.items = [(m, i) for m in metros for i in range(self.root[m]["x"].shape[0])]
        self.mean = np.asarray(mean, np.float32).reshape(1, -1, 1, 1)
        self.std = np.asarray(std, np.float32).reshape(1, -1, 1, 1)
        self.train = train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        m, i = self.items[idx]
        x = self.root[m]["x"][i].astype(np.float32)  # (T, B, H, W)
        y = self.root[m]["y"][i].astype(np.int64)    # (H, W)
        x = (x - self.mean) / self.std
        if self.train:
            if np.random.rand() < 0.5:
                x, y = x[..., ::-1], y[..., ::-1]
            k = np.random.randint(4)
            x, y = np.rot90(x, k, (2, 3)), np.rot90(y, k)
        return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.ascontiguousarray(y))


# ----------------------------------------------------------------------------- model
class TemporalFPN(nn.Module):
    """Shared ConvNeXt encoder per date, temporal fusion by concatenation at each scale."""

    def __init__(self, backbone="convnext_tiny", dim=128):
        super().__init__()
        self.enc = timm.create_model(backbone, features_only=True, in_chans=N_BANDS, pretrained=False)
        chs = self.enc.feature_info.channels()
        self.fuse = nn.ModuleList([nn.Sequential(nn.Conv2d(c * N_DATES, dim, 1), nn.GroupNorm(32, dim), nn.GELU())
                                   for c in chs])
        self.smooth = nn.Sequential(nn.Conv2d(dim, dim, 3, padding=1), nn.GroupNorm(32, dim), nn.GELU())
        self.cls = nn.Conv2d(dim, N_CLASSES, 1)

    def forward(self, x):
        b, t, c, h, w = x.shape
        feats = self.enc(x.flatten(0, 1))
        feats = [f.view(b, t * f.shape[1], *f.shape[-2:]) for f in feats]
        fused = [m(f) for m, f in zip(self.fuse, feats)]
        y = fused[-1]
        for f in reversed(fused[:-1]):
            y = f + F.interpolate(y, size=f.shape[-2:], mode="bilinear", align_corners=False)
        return F.interpolate(self.cls(self.smooth(y)), size=(h, w), mode="bilinear", align_corners=False)


# ----------------------------------------------------------------------------- eval
@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    conf = torch.zeros(N_CLASSES, N_CLASSES, dtype=torch.float64, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(x).argmax(1)
        idx = y.flatten() * N_CLASSES + pred.flatten()
        conf += torch.bincount(idx, minlength=N_CLASSES ** 2).view(N_CLASSES, N_CLASSES).double()
    all_reduce_sum(conf)
    return miou_from_confusion(conf)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg["seed"])

    train_ds = MetroChips(cfg["store"], cfg["train_metros"], cfg["mean"], cfg["std"], train=True)
    val_ds = MetroChips(cfg["store"], cfg["val_metros"], cfg["mean"], cfg["std"], train=False)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg["seed"])
    train_loader = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=sampler,
                              num_workers=cfg["workers"], pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=cfg["batch_size"], shuffle=False,
                            num_workers=cfg["workers"], pin_memory=True)

    model = TemporalFPN(cfg["backbone"]).to(device)
    model = DDP(model, device_ids=[local_rank])
    global_bs = cfg["batch_size"] * world
    lr = cfg["lr"] * global_bs / 256
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=cfg["epochs"] * len(train_loader),
                                                pct_start=0.1)
    class_w = torch.tensor(cfg["class_weights"], device=device)
    if rank == 0:
        os.makedirs(cfg["out_dir"], exist_ok=True)
        print(f"global batch {global_bs}, lr {lr:.2e}, {len(train_ds)} train chips", flush=True)

    best = 0.0
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        for step, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            loss = F.cross_entropy(logits.float(), y, weight=class_w, label_smoothing=0.05)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if rank == 0 and step % 100 == 0:
                print(f"[{epoch}:{step}] loss {loss.item():.4f}", flush=True)

        if rank == 0 and (epoch % cfg["eval_every"] == 0 or epoch == cfg["epochs"] - 1):
            miou, per_class = evaluate(model.module, val_loader, device)
            print(f"epoch {epoch} val mIoU {miou:.4f} | " +
                  " ".join(f"{n}={v:.3f}" for n, v in zip(CLASS_NAMES, per_class)), flush=True)
            if per_class[2] > best:
                best = per_class[2]
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "cfg": cfg,
                            "iou_new_urban": best}, os.path.join(cfg["out_dir"], "best.pt"))
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch},
                       os.path.join(cfg["out_dir"], "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
