"""FastFlow (2D normalizing flows on frozen backbone features) for MVTec AD.

Trains the flow heads with DDP, keeps the best checkpoint by image AUROC, and at the end
re-evaluates the best checkpoint on the full test set (rank 0) and writes metrics.json.

    torchrun --nproc_per_node=2 15_fastflow_train.py --category grid --backbone resnet18
"""
import argparse
import json
import os
from pathlib import Path

import FrEIA.framework as Ff
import FrEIA.modules as Fm
import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T


class MVTec(Dataset):
    def __init__(self, root, category, train, size):
        base = Path(root) / category
        self.paths = sorted((base / ("train" if train else "test")).glob("*/*.png"))
        self.base = base
        tf = [T.Resize((size, size))]
        if train:
            tf += [T.RandomHorizontalFlip(), T.RandomVerticalFlip()]
        self.tf = T.Compose(tf + [T.ToTensor(), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
        self.mtf = T.Compose([T.Resize((size, size), T.InterpolationMode.NEAREST), T.ToTensor()])
        self.size = size

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        p = self.paths[i]
        x = self.tf(Image.open(p).convert("RGB"))
        if p.parent.name == "good":
            return x, torch.zeros(1, self.size, self.size), 0
        return x, (self.mtf(Image.open(self.base / "ground_truth" / p.parent.name / f"{p.stem}_mask.png")) > .5).float(), 1


def subnet_conv(kernel, hidden_ratio):
    def make(cin, cout):
        hidden = int(cin * hidden_ratio)
        return nn.Sequential(nn.Conv2d(cin, hidden, kernel, padding="same"), nn.ReLU(),
                             nn.Conv2d(hidden, cout, kernel, padding="same"))
    return make


def build_flow(c, h, w, steps, hidden_ratio, conv3x3_only):
    nodes = Ff.SequenceINN(c, h, w)
    for i in range(steps):
        k = 3 if (i % 2 == 1 or conv3x3_only) else 1
        nodes.append(Fm.AllInOneBlock, subnet_constructor=subnet_conv(k, hidden_ratio), affine_clamping=2.0,
                     permute_soft=False)
    return nodes


class FastFlowHeads(nn.Module):
    def __init__(self, channels, scales, size, steps=8, hidden_ratio=1.0, conv3x3_only=True):
        super().__init__()
        self.norms = nn.ModuleList([nn.LayerNorm([c, size // s, size // s]) for c, s in zip(channels, scales)])
        self.flows = nn.ModuleList([build_flow(c, size // s, size // s, steps, hidden_ratio, conv3x3_only)
                                    for c, s in zip(channels, scales)])

    def forward(self, feats):
        loss, maps = 0.0, []
        for f, norm, flow in zip(feats, self.norms, self.flows):
            z, log_jac = flow(norm(f))
            loss = loss + torch.mean(0.5 * torch.sum(z ** 2, dim=(1, 2, 3)) - log_jac)
            maps.append(-torch.exp(-0.5 * torch.mean(z ** 2, dim=1, keepdim=True)))
        return loss, maps


def anomaly_map(maps, size):
    return torch.stack([F.interpolate(m, size=size, mode="bilinear", align_corners=False) for m in maps], -1).mean(-1)


@torch.no_grad()
def evaluate(backbone, heads, loader, device, size):
    heads.eval()
    ys, s_img, ms, s_pix = [], [], [], []
    for x, m, y in loader:
        _, maps = heads([f for f in backbone(x.to(device))])
        amap = anomaly_map(maps, (size, size))
        s_img.append(amap.flatten(1).max(1).values.cpu())
        ys.append(y)
        s_pix.append(amap.flatten().cpu())
        ms.append(m.flatten())
    heads.train()
    return (roc_auc_score(torch.cat(ys).numpy(), torch.cat(s_img).numpy()),
            roc_auc_score(torch.cat(ms).numpy().astype(np.uint8), torch.cat(s_pix).numpy()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/mvtec_ad")
    ap.add_argument("--category", default="grid")
    ap.add_argument("--backbone", default="resnet18")
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--flow-steps", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=500)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--eval-interval", type=int, default=10)
    ap.add_argument("--ckpt-dir", default="_fastflow_experiment_checkpoints")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    backbone = timm.create_model(args.backbone, pretrained=True, features_only=True, out_indices=[1, 2, 3])
    backbone = backbone.to(device).eval().requires_grad_(False)
    channels, scales = backbone.feature_info.channels(), backbone.feature_info.reduction()

    def make_heads():
        return FastFlowHeads(channels, scales, args.size, steps=args.flow_steps,
                             conv3x3_only=args.backbone.startswith("resnet18"))

    heads = DDP(make_heads().to(device), device_ids=[local_rank])
    optimizer = torch.optim.Adam(heads.parameters(), lr=args.lr, weight_decay=1e-5)

    train_ds = MVTec(args.data, args.category, True, args.size)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                              pin_memory=True, drop_last=True)
    test_loader = DataLoader(MVTec(args.data, args.category, False, args.size), batch_size=32, num_workers=8)

    ckpt_dir = Path(args.ckpt_dir) / args.category
    best_path = ckpt_dir / "best.pt"
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)

    best_auc = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        total = torch.zeros(2, device=device)
        for x, _, _ in train_loader:
            with torch.no_grad():
                feats = backbone(x.to(device, non_blocking=True))
            loss, _ = heads(feats)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(total)
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs} loss {(total[0] / total[1]).item():.3f}", flush=True)

        if (epoch + 1) % args.eval_interval == 0:
            if rank == 0:
                img_auc, pix_auc = evaluate(backbone, heads.module, test_loader, device, args.size)
                print(f"  image AUROC {img_auc:.4f}  pixel AUROC {pix_auc:.4f}", flush=True)
                if img_auc > best_auc:
                    best_auc = img_auc
                    torch.save({"epoch": epoch, "heads": heads.state_dict(), "image_auroc": img_auc}, best_path)
            dist.barrier()

    if rank == 0:
        ckpt = torch.load(best_path, map_location=device)
        best_heads = make_heads().to(device)
        best_heads.load_state_dict(ckpt["heads"])
        img_auc, pix_auc = evaluate(backbone, best_heads, test_loader, device, args.size)
        res = {"category": args.category, "epoch": ckpt["epoch"], "image_auroc": img_auc, "pixel_auroc": pix_auc}
        print(json.dumps(res), flush=True)
        with open(ckpt_dir / "metrics.json", "w") as f:
            json.dump(res, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
