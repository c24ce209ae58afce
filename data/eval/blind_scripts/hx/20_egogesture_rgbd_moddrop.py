"""EgoGesture (83 classes, egocentric RGB-D) with an RGB frame stream + depth 3D stream and
modality dropout. Subject-independent split from the official protocol.

    torchrun --nproc_per_node=4 20_egogesture_rgbd_moddrop.py --root /data/EgoGesture --wandb
"""
import argparse
import csv
import glob
import json
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

VAL_SUBJECTS = [2, 9, 11, 14, 18, 19, 28, 31, 41, 47]
TEST_SUBJECTS = [1, 7, 12, 13, 24, 29, 33, 34, 35, 37]


def build_index(root):
    """Scan labels-final-revised1/subjectXX/SceneY/Group*.csv -> list of gesture segments."""
    index = []
    for csv_path in sorted(glob.glob(os.path.join(root, "labels-final-revised1", "subject*", "Scene*", "Group*.csv"))):
        subject = int(csv_path.split(os.sep)[-3].replace("subject", ""))
        scene = csv_path.split(os.sep)[-2]
        group = os.path.splitext(os.path.basename(csv_path))[0].replace("Group", "")
        with open(csv_path) as f:
            for row in csv.reader(f):
                label, start, end = int(row[0]) - 1, int(row[1]), int(row[2])
                index.append({"subject": subject, "scene": scene, "rec": f"Color/rgb{group}",
                              "depth": f"Depth/depth{group}", "label": label, "start": start, "end": end})
    return index


def load_or_build_index(root, cache_file, rank):
    if rank == 0 and not os.path.exists(cache_file):
        index = build_index(root)
        tmp = cache_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump(index, f)
        os.replace(tmp, cache_file)
    dist.barrier()  # other ranks wait until rank 0 has finished writing
    with open(cache_file) as f:
        return json.load(f)


class EgoGestureClips(Dataset):
    def __init__(self, root, items, frames=8, train=True):
        self.img_root = os.path.join(root, "images")
        self.items, self.frames, self.train = items, frames, train

    def __len__(self):
        return len(self.items)

    def _load(self, folder, idx, mode):
        imgs = []
        for j in idx:
            im = Image.open(os.path.join(folder, f"{j:06d}.jpg")).convert(mode).resize((160, 120))
            imgs.append(np.asarray(im, dtype=np.float32) / 255.0)
        return np.stack(imgs)

    def __getitem__(self, i):
        it = self.items[i]
        base = os.path.join(self.img_root, f"subject{it['subject']:02d}", it["scene"])
        seg = np.linspace(it["start"], it["end"] + 1, self.frames + 1)
        if self.train:
            idx = [random.randint(int(a), max(int(a), int(b) - 1)) for a, b in zip(seg[:-1], seg[1:])]
        else:
            idx = [int((a + b) / 2) for a, b in zip(seg[:-1], seg[1:])]
        rgb = torch.from_numpy(self._load(os.path.join(base, it["rec"]), idx, "RGB")).permute(0, 3, 1, 2)
        depth = torch.from_numpy(self._load(os.path.join(base, it["depth"]), idx, "L"))[None]  # 1 T H W
        if self.train:
            y0, x0 = random.randint(0, 8), random.randint(0, 16)
        else:
            y0, x0 = 4, 8
        rgb, depth = rgb[..., y0:y0 + 112, x0:x0 + 144], depth[..., y0:y0 + 112, x0:x0 + 144]
        rgb = torchvision.transforms.functional.normalize(rgb, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        return rgb, (depth - 0.5) / 0.25, it["label"]


class DepthStream(nn.Module):
    def __init__(self, dim=256):
        super().__init__()

        def blk(cin, cout, stride):
            return nn.Sequential(nn.Conv3d(cin, cout, 3, stride, 1, bias=False), nn.GroupNorm(8, cout), nn.ReLU(True))

        self.net = nn.Sequential(blk(1, 32, (1, 2, 2)), blk(32, 64, (1, 2, 2)), blk(64, 128, 2), blk(128, dim, 2))

    def forward(self, x):
        return self.net(x).mean(dim=(2, 3, 4))


class RGBDNet(nn.Module):
    def __init__(self, num_classes=83, dim=256, p_drop=0.25):
        super().__init__()
        r18 = torchvision.models.resnet18(weights="IMAGENET1K_V1")
        r18.fc = nn.Identity()
        self.rgb = r18
        self.rgb_proj = nn.Linear(512, dim)
        self.depth = DepthStream(dim)
        self.p_drop = p_drop
        self.cls = nn.Sequential(nn.Dropout(0.3), nn.Linear(dim, num_classes))

    def forward(self, rgb, depth):
        b, t = rgb.shape[:2]
        use_rgb = use_depth = True
        if self.training and random.random() < self.p_drop:
            # drop one of the two modalities for this batch
            if random.random() < 0.5:
                use_rgb = False
            else:
                use_depth = False
        feats = []
        if use_rgb:
            feats.append(self.rgb_proj(self.rgb(rgb.flatten(0, 1)).view(b, t, -1).mean(1)))
        if use_depth:
            feats.append(self.depth(depth))
        return self.cls(torch.stack(feats).mean(0))


def strip_module_prefix(state):
    return {(k[len("module."):] if k.startswith("module.") else k): v for k, v in state.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/EgoGesture")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--resume", default="")
    ap.add_argument("--out", default="runs/egogesture_rgbd")
    ap.add_argument("--wandb", action="store_true")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(1000 + rank)
    torch.manual_seed(1000)

    run = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        if args.wandb:
            import wandb
            run = wandb.init(project="egogesture", config=vars(args), dir=args.out)

    index = load_or_build_index(args.root, os.path.join(args.root, "segments_index.json"), rank)
    train_items = [it for it in index if it["subject"] not in VAL_SUBJECTS + TEST_SUBJECTS]
    val_items = [it for it in index if it["subject"] in VAL_SUBJECTS]
    train_ds, val_ds = EgoGestureClips(args.root, train_items, train=True), EgoGestureClips(args.root, val_items, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=1000)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), 32, num_workers=8, pin_memory=True)

    model = RGBDNet()
    start_epoch, best = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(strip_module_prefix(ckpt["model"]))
        start_epoch, best = ckpt.get("epoch", -1) + 1, ckpt.get("best", 0.0)
    model = model.to(device)
    # modality dropout skips a whole stream in some steps, so not every parameter gets a gradient
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * world * args.batch_size / 64, momentum=0.9,
                                weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs)
    if args.resume and "optimizer" in ckpt:
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        run_loss = torch.zeros(2, device=device)
        for rgb, depth, y in train_dl:
            rgb, depth, y = rgb.to(device, non_blocking=True), depth.to(device, non_blocking=True), y.to(device)
            loss = F.cross_entropy(model(rgb, depth), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            run_loss += torch.stack([loss.detach(), torch.ones((), device=device)])
        scheduler.step()

        model.eval()
        hits = torch.zeros(2, device=device)
        with torch.no_grad():
            for rgb, depth, y in val_dl:
                pred = model(rgb.to(device), depth.to(device)).argmax(1)
                hits += torch.stack([(pred == y.to(device)).sum().float(), torch.tensor(float(len(y)), device=device)])
        dist.all_reduce(hits)
        dist.all_reduce(run_loss)
        acc, train_loss = (hits[0] / hits[1]).item(), (run_loss[0] / run_loss[1]).item()
        if rank == 0:
            print(f"epoch {epoch} train loss {train_loss:.4f} val acc {acc * 100:.2f} ({time.time() - t0:.0f}s)",
                  flush=True)
            if run is not None:
                run.log({"train/loss": train_loss, "val/acc": acc, "lr": scheduler.get_last_lr()[0]}, step=epoch)
            best = max(best, acc)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch, "best": best}
            torch.save(state, os.path.join(args.out, "last.pth"))
            if acc == best:
                torch.save(state, os.path.join(args.out, "best.pth"))
        dist.barrier()

    if run is not None:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
