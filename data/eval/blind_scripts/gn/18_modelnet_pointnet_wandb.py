"""PointNet classification on ModelNet40 (pre-sampled .npz), DDP, tracked in Weights & Biases.

Overall and mean-class accuracy every --eval-every epochs, best checkpoint by
mean-class accuracy, early stopping, final test with the best weights.

    torchrun --nproc_per_node=4 18_modelnet_pointnet_wandb.py --data /data/modelnet40_2048.npz
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

N_CLASSES = 40


class PointClouds(Dataset):
    def __init__(self, points, labels, n_points, train):
        self.points, self.labels, self.n_points, self.train = points, labels, n_points, train

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        pts = self.points[i]
        if self.train:
            pts = pts[np.random.choice(len(pts), self.n_points, replace=False)]
            pts = pts * np.random.uniform(0.8, 1.25, size=(1, 3)) + np.random.uniform(-0.1, 0.1, size=(1, 3))
            pts = pts + np.clip(0.01 * np.random.randn(*pts.shape), -0.05, 0.05)
        else:
            pts = pts[: self.n_points]
        return torch.from_numpy(pts.astype(np.float32)).t(), int(self.labels[i])


def seed_worker(worker_id):
    np.random.seed(torch.initial_seed() % 2**32)


class PointNet(nn.Module):
    def __init__(self, k=N_CLASSES):
        super().__init__()
        dims = [3, 64, 64, 64, 128, 1024]
        self.convs = nn.ModuleList([nn.Conv1d(a, b, 1) for a, b in zip(dims[:-1], dims[1:])])
        self.bns = nn.ModuleList([nn.BatchNorm1d(b) for b in dims[1:]])
        self.fc = nn.Sequential(nn.Linear(1024, 512), nn.BatchNorm1d(512), nn.ReLU(), nn.Dropout(0.4),
                                nn.Linear(512, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Dropout(0.4),
                                nn.Linear(256, k))

    def forward(self, x):
        for conv, bn in zip(self.convs, self.bns):
            x = F.relu(bn(conv(x)))
        return self.fc(x.max(dim=2).values)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    per_class = torch.zeros(2, N_CLASSES, device=device)  # correct, count
    for pts, y in loader:
        pts, y = pts.to(device), y.to(device)
        pred = model(pts).argmax(1)
        per_class[0].index_add_(0, y, (pred == y).float())
        per_class[1].index_add_(0, y, torch.ones_like(y, dtype=torch.float))
    dist.all_reduce(per_class)
    model.train()
    overall = (per_class[0].sum() / per_class[1].sum()).item()
    mean_class = (per_class[0] / per_class[1].clamp(min=1)).mean().item()
    return overall, mean_class


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", default="runs/pointnet_mn40")
    parser.add_argument("--project", default="pointcloud-cls")
    parser.add_argument("--n-points", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--epochs", type=int, default=250)
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument("--patience", type=int, default=15)
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    np.random.seed(rank)

    run = wandb.init(project=args.project, config=vars(args), name=f"pointnet-{args.n_points}pts")

    data = np.load(args.data)
    train_ds = PointClouds(data["train_points"], data["train_labels"], args.n_points, train=True)
    test_ds = PointClouds(data["test_points"], data["test_labels"], args.n_points, train=False)
    # fixed held-out 10% of train for selection; the official test split is only used once at the end
    perm = np.random.RandomState(0).permutation(len(train_ds))
    n_val = len(perm) // 10
    val_ds = Subset(PointClouds(data["train_points"], data["train_labels"], args.n_points, train=False),
                    perm[:n_val].tolist())
    train_ds = Subset(train_ds, perm[n_val:].tolist())

    sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                              drop_last=True, pin_memory=True,
                              worker_init_fn=seed_worker)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=128)
    test_loader = DataLoader(Subset(test_ds, range(rank, len(test_ds), world)), batch_size=128)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(PointNet()).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.7)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best_file = os.path.join(args.out, "best.pth")
    best_macc, evals_since = 0.0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for pts, y in train_loader:
            pts, y = pts.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(pts), y, label_smoothing=0.2)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        scheduler.step()
        run.log({"train/loss": loss.item(), "lr": scheduler.get_last_lr()[0], "epoch": epoch})

        if (epoch + 1) % args.eval_every:
            continue
        oa, macc = evaluate(model.module, val_loader, device)
        run.log({"val/overall_acc": oa, "val/mean_class_acc": macc, "epoch": epoch})
        if rank == 0:
            print(f"epoch {epoch} OA {oa:.4f} mAcc {macc:.4f} ({time.time() - t0:.1f}s)", flush=True)
        if macc > best_macc:
            best_macc, evals_since = macc, 0
            if rank == 0:
                torch.save({"epoch": epoch, "model": model.module.state_dict(), "macc": macc}, best_file)
        else:
            evals_since += 1
            if evals_since >= args.patience:
                break

    dist.barrier()
    ckpt = torch.load(best_file, map_location=device)
    model.module.load_state_dict(ckpt["model"])
    oa, macc = evaluate(model.module, test_loader, device)
    run.summary.update({"test/overall_acc": oa, "test/mean_class_acc": macc, "best_epoch": ckpt["epoch"]})
    if rank == 0:
        print(f"test with best (epoch {ckpt['epoch']}): OA {oa:.4f} mAcc {macc:.4f}")
    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
