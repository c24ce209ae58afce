"""Skip-connection-free U-Net autoencoder for connector pin inspection + TorchScript export.

Trains on good connector images, keeps the checkpoint with the lowest
validation reconstruction error, and at the end exports a TorchScript model
(with the anomaly-map post-processing baked in) for the line PC.

    torchrun --nproc_per_node=4 18_connector_pin_ae.py --data /data/connector_pins --out /shared/pins/ae_v4
"""
import argparse
import json
import os
import time

import numpy as np
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


class PinImages(Dataset):
    def __init__(self, root, split, size, augment=False):
        base = os.path.join(root, split)
        self.items = []
        for label_dir in sorted(os.listdir(base)):
            for f in sorted(os.listdir(os.path.join(base, label_dir))):
                self.items.append((os.path.join(base, label_dir, f), int(label_dir != "good")))
        aug = [transforms.RandomAffine(degrees=2, translate=(0.01, 0.01)),
               transforms.ColorJitter(brightness=0.05)] if augment else []
        self.tf = transforms.Compose([transforms.Grayscale(), transforms.Resize((size, size))] + aug +
                                     [transforms.ToTensor()])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, y = self.items[i]
        return self.tf(Image.open(path)), y


def block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(8, cout), nn.SiLU(),
                         nn.Conv2d(cout, cout, 3, padding=1), nn.GroupNorm(8, cout), nn.SiLU())


class PinAE(nn.Module):
    def __init__(self, base=32, depth=4):
        super().__init__()
        chans = [base * 2 ** i for i in range(depth)]
        self.inc = block(1, chans[0])
        self.downs = nn.ModuleList([block(chans[i], chans[i + 1]) for i in range(depth - 1)])
        self.bottleneck = nn.Sequential(nn.Conv2d(chans[-1], 16, 1), nn.SiLU(), nn.Conv2d(16, chans[-1], 1))
        self.ups = nn.ModuleList([block(chans[i + 1], chans[i]) for i in reversed(range(depth - 1))])
        self.outc = nn.Conv2d(chans[0], 1, 1)

    def forward(self, x):
        h = self.inc(x)
        for d in self.downs:
            h = d(F.max_pool2d(h, 2))
        h = self.bottleneck(h)
        for u in self.ups:
            h = u(F.interpolate(h, scale_factor=2, mode="nearest"))
        return torch.sigmoid(self.outc(h))


class ExportWrapper(nn.Module):
    """Input: uint8 grayscale image batch (N,1,H,W). Output: (anomaly map, image score)."""

    def __init__(self, ae, size, sigma=2.0):
        super().__init__()
        self.ae, self.size = ae, size
        r = int(3 * sigma)
        k = torch.exp(-torch.arange(-r, r + 1, dtype=torch.float32) ** 2 / (2 * sigma ** 2))
        self.register_buffer("k", (k / k.sum()).view(1, 1, 1, -1))
        self.r = r

    def forward(self, img_u8: torch.Tensor):
        x = F.interpolate(img_u8.float() / 255.0, size=(self.size, self.size), mode="bilinear", align_corners=False)
        err = (self.ae(x) - x) ** 2
        err = F.conv2d(err, self.k, padding=(0, self.r))
        err = F.conv2d(err, self.k.transpose(2, 3), padding=(self.r, 0))
        return err, err.flatten(1).amax(1)


def run_eval(net, loader, device):
    net.eval()
    rec_sum, n, scores, labels = 0.0, 0, [], []
    with torch.no_grad():
        for x, y in loader:
            x = x.to(device)
            err = (net(x) - x) ** 2
            rec_sum += err.mean(dim=(1, 2, 3))[y == 0].sum().item()
            n += int((y == 0).sum())
            scores += F.avg_pool2d(err, 8).flatten(1).amax(1).cpu().tolist()
            labels += y.tolist()
    net.train()
    auroc = roc_auc_score(labels, scores) if len(set(labels)) > 1 else float("nan")
    return rec_sum / max(n, 1), auroc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--size", type=int, default=320)
    ap.add_argument("--epochs", type=int, default=120)
    ap.add_argument("--batch-size", type=int, default=12, help="per GPU")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--workers", type=int, default=6)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_ds = PinImages(args.data, "train", args.size, augment=True)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        val_dl = DataLoader(PinImages(args.data, "val", args.size), batch_size=32, num_workers=4)

    torch.manual_seed(0)
    model = DDP(PinAE().to(device), device_ids=[local_rank])
    # lr chosen for 4 GPUs x 12; keep lr / global batch constant on other node sizes
    lr = args.lr * (args.batch_size * world) / 48
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=args.epochs * len(train_dl))

    best_path = os.path.join(args.out, "best.pt")
    best_rec, history = float("inf"), []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        acc = torch.zeros(2, device=device)
        for x, _ in train_dl:
            x = x.to(device, non_blocking=True)
            loss = F.mse_loss(model(x), x)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(acc)

        if rank == 0:
            val_rec, val_auroc = run_eval(model.module, val_dl, device)
            history.append({"epoch": epoch, "train": (acc[0] / acc[1]).item(), "val_rec": val_rec,
                            "val_auroc": val_auroc})
            print(f"epoch {epoch:3d} train {(acc[0] / acc[1]).item():.5f} val-rec {val_rec:.5f} "
                  f"val-AUROC {val_auroc:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if val_rec < best_rec:
                best_rec = val_rec
                torch.save(model.state_dict(), best_path)
        dist.barrier()

    if rank == 0:
        with open(os.path.join(args.out, "history.json"), "w") as f:
            json.dump(history, f, indent=1)
        export_ae = PinAE()
        export_ae.load_state_dict(torch.load(best_path, map_location="cpu"))
        wrapper = ExportWrapper(export_ae.eval(), args.size).eval()
        example = torch.randint(0, 255, (1, 1, 480, 640), dtype=torch.uint8)
        scripted = torch.jit.trace(wrapper, example)
        scripted.save(os.path.join(args.out, "pin_ae_traced.pt"))
        print(f"exported {os.path.join(args.out, 'pin_ae_traced.pt')} (best val-rec {best_rec:.5f})")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
