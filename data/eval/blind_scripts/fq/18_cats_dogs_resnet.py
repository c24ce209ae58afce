"""
Dogs vs. Cats (Kaggle) - fine-tune ResNet-34 with DDP (mp.spawn), then predict the test set
with the best checkpoint and write submission.csv.

    python 18_cats_dogs_resnet.py --train-dir train --test-dir test1 --gpus 4
"""
import argparse
import glob
import os
import time

import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models, transforms

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


class CatsDogs(Dataset):
    def __init__(self, files, transform, with_labels=True):
        self.files, self.transform, self.with_labels = files, transform, with_labels

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        path = self.files[i]
        img = self.transform(Image.open(path).convert("RGB"))
        if self.with_labels:
            return img, 1 if os.path.basename(path).startswith("dog") else 0
        return img, int(os.path.splitext(os.path.basename(path))[0])


def build_model():
    net = models.resnet34(weights=models.ResNet34_Weights.IMAGENET1K_V1)
    net.fc = nn.Sequential(nn.Dropout(0.3), nn.Linear(net.fc.in_features, 2))
    return net


def split_files(train_dir, val_every=10):
    files = sorted(glob.glob(os.path.join(train_dir, "*.jpg")))
    val = files[::val_every]
    val_set = set(val)
    train = [f for f in files if f not in val_set]
    return train, val


def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(3, device=device)
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            out = model(x)
            s[0] += F.cross_entropy(out, y, reduction="sum")
            s[1] += (out.argmax(1) == y).sum()
            s[2] += y.size(0)
    dist.all_reduce(s)
    return (s[0] / s[2]).item(), (s[1] / s[2]).item()


def predict_test(args, device):
    model = build_model()
    state = torch.load(os.path.join(args.out, "best.pth"), map_location=device)
    model.load_state_dict(state)
    model.to(device).eval()

    tf = transforms.Compose([transforms.Resize((224, 224)), transforms.ToTensor(),
                             transforms.Normalize(MEAN, STD)])
    files = sorted(glob.glob(os.path.join(args.test_dir, "*.jpg")))
    loader = DataLoader(CatsDogs(files, tf, with_labels=False), batch_size=128, num_workers=args.workers)
    ids, probs = [], []
    with torch.no_grad():
        for x, idx in loader:
            x = x.to(device)
            p = (F.softmax(model(x), 1)[:, 1] + F.softmax(model(torch.flip(x, dims=[3])), 1)[:, 1]) / 2
            probs.extend(p.clamp(0.005, 0.995).cpu().tolist())
            ids.extend(idx.tolist())
    sub = pd.DataFrame({"id": ids, "label": probs}).sort_values("id")
    sub.to_csv(os.path.join(args.out, "submission.csv"), index=False)
    print(f"wrote {len(sub)} predictions")


def worker(rank, world_size, args):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "29610"
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(0)

    train_files, val_files = split_files(args.train_dir)
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224, scale=(0.6, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), transforms.Normalize(MEAN, STD),
    ])
    val_tf = transforms.Compose([transforms.Resize((224, 224)), transforms.ToTensor(),
                                 transforms.Normalize(MEAN, STD)])
    train_ds, val_ds = CatsDogs(train_files, train_tf), CatsDogs(val_files, val_tf)
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    val_sampler = DistributedSampler(val_ds, num_replicas=world_size, rank=rank, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                          num_workers=args.workers, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=128, sampler=val_sampler,
                        num_workers=args.workers, pin_memory=True)

    model = build_model().to(device)
    model = DDP(model, device_ids=[rank])
    lr = args.lr * args.batch_size * world_size / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, epochs=args.epochs,
                                                    steps_per_epoch=len(train_dl))

    best_loss = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
        val_loss, val_acc = evaluate(model, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs} val_loss {val_loss:.4f} val_acc {val_acc:.4f} "
                  f"({time.time() - t0:.0f}s)")
            if val_loss < best_loss:
                best_loss = val_loss
                torch.save(model.state_dict(), os.path.join(args.out, "best.pth"))
        dist.barrier()

    if rank == 0:
        predict_test(args, device)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-dir", default="train")
    ap.add_argument("--test-dir", default="test1")
    ap.add_argument("--out", default="out_catsdogs")
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=64, help="per GPU")
    ap.add_argument("--lr", type=float, default=0.01, help="for a total batch of 256")
    ap.add_argument("--workers", type=int, default=6)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    build_model()  # download the ImageNet weights once before the workers start
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)
