"""
Pneumonia detection on chest X-rays (Kermany et al. / Kaggle "chest_xray") with DenseNet-121.
DDP training, best checkpoint by val AUC, final report on the held-out test split.

torchrun --nproc_per_node=2 14_chest_xray_densenet.py --root data/chest_xray --epochs 20
"""
import argparse
import os
import time

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.metrics import confusion_matrix, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, models, transforms
from tqdm import tqdm


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default="data/chest_xray")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--img-size", type=int, default=256)
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--out", default="xray_runs")
    return parser.parse_args()


def get_loaders(root, img_size, batch_size, workers):
    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([
        transforms.Grayscale(num_output_channels=3),
        transforms.RandomResizedCrop(img_size, scale=(0.8, 1.0)),
        transforms.RandomRotation(10),
        transforms.ToTensor(),
        norm,
    ])
    eval_tf = transforms.Compose([
        transforms.Grayscale(num_output_channels=3),
        transforms.Resize((img_size, img_size)),
        transforms.ToTensor(),
        norm,
    ])
    train_ds = datasets.ImageFolder(os.path.join(root, "train"), train_tf)
    val_ds = datasets.ImageFolder(os.path.join(root, "val"), eval_tf)
    test_ds = datasets.ImageFolder(os.path.join(root, "test"), eval_tf)

    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=batch_size, sampler=sampler, num_workers=workers,
                              pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=64, num_workers=workers)
    test_loader = DataLoader(test_ds, batch_size=64, num_workers=workers)
    return train_ds, sampler, train_loader, val_loader, test_loader


def build_model():
    m = models.densenet121(weights=models.DenseNet121_Weights.IMAGENET1K_V1)
    m.classifier = nn.Linear(m.classifier.in_features, 1)
    return m


@torch.no_grad()
def predict_probs(model, loader, device):
    model.eval()
    probs, ys = [], []
    for x, y in loader:
        logits = model(x.to(device)).squeeze(1)
        probs.append(torch.sigmoid(logits).cpu())
        ys.append(y)
    return torch.cat(probs).numpy(), torch.cat(ys).numpy()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_ds, sampler, train_loader, val_loader, test_loader = get_loaders(
        args.root, args.img_size, args.batch_size, args.workers)

    model = build_model().to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])

    # PNEUMONIA is ~3x NORMAL in train
    n_pos = sum(1 for _, y in train_ds.samples if y == 1)
    n_neg = len(train_ds) - n_pos
    criterion = nn.BCEWithLogitsLoss(pos_weight=torch.tensor([n_neg / n_pos], device=device))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.3)

    best_path = os.path.join(args.out, "densenet121_best.pt")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"classes {train_ds.class_to_idx}, {len(train_ds)} train images on {world_size} GPUs")

    history = {"loss": [], "val_auc": []}
    best_auc = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for x, y in tqdm(train_loader, disable=rank != 0, leave=False):
            x, y = x.to(device, non_blocking=True), y.float().to(device, non_blocking=True)
            optimizer.zero_grad()
            loss = criterion(model(x).squeeze(1), y)
            loss.backward()
            optimizer.step()
            running += torch.stack([loss.detach() * x.size(0), torch.tensor(float(x.size(0)), device=device)])
        scheduler.step()
        dist.all_reduce(running)
        epoch_loss = (running[0] / running[1]).item()

        if rank == 0:
            probs, ys = predict_probs(model.module, val_loader, device)
            auc = roc_auc_score(ys, probs)
            history["loss"].append(epoch_loss)
            history["val_auc"].append(auc)
            print(f"epoch {epoch + 1:02d}/{args.epochs} loss {epoch_loss:.4f} val AUC {auc:.4f} "
                  f"({time.time() - t0:.0f}s)")
            if auc > best_auc:
                best_auc = auc
                torch.save(model.state_dict(), best_path)
                print(f"  saved best model (AUC {auc:.4f})")
        dist.barrier()

    if rank == 0:
        # final evaluation of the best checkpoint on the test split
        test_model = build_model().to(device)
        test_model.load_state_dict(torch.load(best_path, map_location=device))
        probs, ys = predict_probs(test_model, test_loader, device)
        preds = (probs > 0.5).astype(int)
        tn, fp, fn, tp = confusion_matrix(ys, preds).ravel()
        print(f"TEST  AUC {roc_auc_score(ys, probs):.4f}  acc {(tp + tn) / len(ys):.4f}  "
              f"sensitivity {tp / (tp + fn):.4f}  specificity {tn / (tn + fp):.4f}")

        fig, ax = plt.subplots(1, 2, figsize=(10, 4))
        ax[0].plot(history["loss"])
        ax[0].set_title("train loss")
        ax[1].plot(history["val_auc"])
        ax[1].set_title("val AUC")
        fig.savefig(os.path.join(args.out, "training.png"))

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
