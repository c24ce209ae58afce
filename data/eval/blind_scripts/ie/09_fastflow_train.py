"""FastFlow (2D normalizing flow on CNN features) for surface inspection of
brushed-aluminium panels. One model per product line.

    torchrun --nproc_per_node=4 fastflow_train.py --line alu_brushed_2mm \
        --data /mnt/datasets/alu --out /mnt/experiments/fastflow
"""
import argparse
import json
import os
import time
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
from torchvision import transforms


def parse_args():
    parser = argparse.ArgumentParser(description="FastFlow training")
    parser.add_argument("--data", type=str, required=True)
    parser.add_argument("--line", type=str, required=True)
    parser.add_argument("--out", type=str, default="./runs")
    parser.add_argument("--backbone", type=str, default="resnet18")
    parser.add_argument("--flow-steps", type=int, default=8)
    parser.add_argument("--hidden-ratio", type=float, default=1.0)
    parser.add_argument("--input-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=1e-5)
    parser.add_argument("--eval-interval", type=int, default=10)
    parser.add_argument("--num-workers", type=int, default=8)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


class PanelDataset(Dataset):
    def __init__(self, root, split, size, train):
        root = Path(root)
        self.samples = []
        for sub in sorted((root / split).iterdir()):
            for f in sorted(sub.glob("*.png")):
                mask = root / "ground_truth" / sub.name / f"{f.stem}_mask.png"
                self.samples.append((f, mask if mask.exists() else None, int(sub.name != "good")))
        aug = [transforms.RandomHorizontalFlip(), transforms.RandomVerticalFlip()] if train else []
        self.tf = transforms.Compose([transforms.Resize((size, size))] + aug + [
            transforms.ToTensor(), transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
        self.size = size

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        f, m, y = self.samples[i]
        x = self.tf(Image.open(f).convert("RGB"))
        if m is None:
            mask = torch.zeros(1, self.size, self.size)
        else:
            mask = transforms.functional.to_tensor(Image.open(m).convert("L").resize((self.size, self.size), Image.NEAREST))
        return x, (mask > 0.5).float(), y


def subnet_conv(kernel, hidden_ratio):
    def make(cin, cout):
        hidden = int(cin * hidden_ratio)
        return nn.Sequential(nn.Conv2d(cin, hidden, kernel, padding="same"), nn.ReLU(),
                             nn.Conv2d(hidden, cout, kernel, padding="same"))
    return make


def build_flow(c, h, w, steps, hidden_ratio):
    nodes = Ff.SequenceINN(c, h, w)
    for i in range(steps):
        k = 1 if i % 2 == 1 else 3
        nodes.append(Fm.AllInOneBlock, subnet_constructor=subnet_conv(k, hidden_ratio),
                     affine_clamping=2.0, permute_soft=False)
    return nodes


class FastFlow(nn.Module):
    def __init__(self, backbone, size, steps, hidden_ratio):
        super().__init__()
        self.feature_extractor = timm.create_model(backbone, pretrained=True, features_only=True, out_indices=[1, 2, 3])
        for p in self.feature_extractor.parameters():
            p.requires_grad_(False)
        channels = self.feature_extractor.feature_info.channels()
        scales = self.feature_extractor.feature_info.reduction()
        self.norms = nn.ModuleList([nn.LayerNorm([c, size // s, size // s], elementwise_affine=True)
                                    for c, s in zip(channels, scales)])
        self.flows = nn.ModuleList([build_flow(c, size // s, size // s, steps, hidden_ratio)
                                    for c, s in zip(channels, scales)])
        self.size = size

    def forward(self, x):
        self.feature_extractor.eval()
        with torch.no_grad():
            feats = self.feature_extractor(x)
        loss, maps = 0.0, []
        for f, norm, flow in zip(feats, self.norms, self.flows):
            z, log_jac = flow(norm(f))
            loss = loss + torch.mean(0.5 * torch.sum(z ** 2, dim=(1, 2, 3)) - log_jac)
            log_p = -0.5 * torch.mean(z ** 2, dim=1, keepdim=True)
            maps.append(F.interpolate(-torch.exp(log_p), size=self.size, mode="bilinear", align_corners=False))
        amap = torch.mean(torch.stack(maps, -1), -1)
        return loss, amap


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    ys, scores, masks, maps = [], [], [], []
    for x, m, y in loader:
        _, amap = model(x.to(device))
        ys += y.tolist()
        scores += amap.flatten(1).max(1).values.cpu().tolist()
        masks.append(m.numpy().ravel())
        maps.append(amap.cpu().numpy().ravel())
    model.train()
    return roc_auc_score(ys, scores), roc_auc_score(np.concatenate(masks), np.concatenate(maps))


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    out_dir = Path(args.out) / args.line
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        with open(out_dir / "args.json", "w") as f:
            json.dump(vars(args), f, indent=2)

    train_set = PanelDataset(Path(args.data) / args.line, "train", args.input_size, train=True)
    test_set = PanelDataset(Path(args.data) / args.line, "test", args.input_size, train=False)
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size // world_size, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=16, shuffle=False, num_workers=4)

    model = FastFlow(args.backbone, args.input_size, args.flow_steps, args.hidden_ratio).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad],
                                 lr=args.lr, weight_decay=args.weight_decay)

    best_px = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_meter = torch.zeros(2, device=device)
        for x, _, _ in train_loader:
            x = x.to(device, non_blocking=True)
            loss, _ = model(x)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loss_meter += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(loss_meter)
        if rank == 0:
            print(f"[{args.line}] epoch {epoch + 1}/{args.epochs} loss {(loss_meter[0] / loss_meter[1]).item():.3f} "
                  f"time {time.time() - t0:.1f}s")

        if (epoch + 1) % args.eval_interval == 0:
            if rank == 0:
                img_auc, px_auc = evaluate(model.module, test_loader, device)
                print(f"[{args.line}] epoch {epoch + 1} image AUROC {img_auc:.4f} pixel AUROC {px_auc:.4f}")
                torch.save({"epoch": epoch, "state_dict": model.module.state_dict(),
                            "optimizer": optimizer.state_dict()}, out_dir / "last.pt")
                if px_auc > best_px:
                    best_px = px_auc
                    torch.save({"epoch": epoch, "state_dict": model.module.state_dict(),
                                "pixel_auroc": px_auc}, out_dir / "best.pt")
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
