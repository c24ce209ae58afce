"""
FedAvg on an iNaturalist user split (each observer = one client), MobileNetV3 backbone.

CSV layout (train and test):  user_id,image_path,species
    torchrun --nproc_per_node=8 09_fedavg_inat_users.py \
        --train-csv /data/inat_fed/train_users.csv --test-csv /data/inat_fed/test.csv
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision import models, transforms


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--train-csv", required=True)
    p.add_argument("--test-csv", required=True)
    p.add_argument("--image-root", default="/data/inat_fed/images")
    p.add_argument("--out", default="/shared/exp/inat_fedavg")
    p.add_argument("--clients-per-round", type=int, default=40)
    p.add_argument("--rounds", type=int, default=2000)
    p.add_argument("--local-epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--min-images", type=int, default=8, help="drop users with fewer images")
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--eval-every", type=int, default=100)
    return p.parse_args()


class ImageTable(Dataset):
    def __init__(self, rows, root, class_to_idx, tf):
        self.paths = rows["image_path"].tolist()
        self.labels = [class_to_idx[s] for s in rows["species"]]
        self.root, self.tf = root, tf

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.root, self.paths[i])).convert("RGB")
        return self.tf(img), self.labels[i]


def build_model(num_classes):
    m = models.mobilenet_v3_small(weights=models.MobileNet_V3_Small_Weights.IMAGENET1K_V1)
    m.classifier[-1] = nn.Linear(m.classifier[-1].in_features, num_classes)
    return m


def local_fit(model, loader, epochs, lr, device):
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=4e-5)
    for _ in range(epochs):
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    hit1 = torch.zeros((), device=device)
    hit5 = torch.zeros((), device=device)
    cnt = torch.zeros((), device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        top5 = logits.topk(5, dim=1).indices
        hit1 += (top5[:, 0] == y).sum()
        hit5 += (top5 == y[:, None]).any(1).sum()
        cnt += y.numel()
    for t in (hit1, hit5, cnt):
        dist.all_reduce(t)
    return (hit1 / cnt).item(), (hit5 / cnt).item()


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)

    train_df = pd.read_csv(args.train_csv)
    test_df = pd.read_csv(args.test_csv)
    counts = train_df.groupby("user_id").size()
    users = sorted(counts[counts >= args.min_images].index.tolist())
    train_df = train_df[train_df.user_id.isin(users)]
    species = list(set(train_df["species"]))
    class_to_idx = {s: i for i, s in enumerate(species)}
    test_df = test_df[test_df.species.isin(list(class_to_idx))]
    by_user = {u: g for u, g in train_df.groupby("user_id")}
    if rank == 0:
        print(f"{len(users)} clients, {len(species)} species, {len(train_df)} train images", flush=True)

    norm = transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    tf_train = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(), norm])
    tf_test = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224),
                                  transforms.ToTensor(), norm])
    test_ds = ImageTable(test_df.iloc[rank::world], args.image_root, class_to_idx, tf_test)
    test_loader = DataLoader(test_ds, batch_size=128, num_workers=8, pin_memory=True)

    if local_rank == 0:
        build_model(len(species))  # fill the torch hub weight cache once per node
    dist.barrier()
    global_model = build_model(len(species)).to(device)
    client_model = build_model(len(species)).to(device)
    for t in global_model.state_dict().values():
        dist.broadcast(t, src=0)
    float_keys = [k for k, v in global_model.state_dict().items() if v.is_floating_point()]

    for rnd in range(args.rounds):
        t0 = time.time()
        picks = np.random.default_rng([args.seed, rnd]).choice(len(users), args.clients_per_round, replace=False)
        my_users = [users[i] for i in picks[rank::world]]

        sums = {k: torch.zeros_like(global_model.state_dict()[k]) for k in float_keys}
        weight = torch.zeros((), device=device)
        for u in my_users:
            client_model.load_state_dict(global_model.state_dict())
            ds = ImageTable(by_user[u], args.image_root, class_to_idx, tf_train)
            loader = DataLoader(ds, batch_size=args.batch_size, shuffle=True, num_workers=4,
                                pin_memory=True, drop_last=len(ds) > args.batch_size)
            local_fit(client_model, loader, args.local_epochs, args.lr, device)
            csd = client_model.state_dict()
            for k in float_keys:
                sums[k].add_(csd[k], alpha=len(ds))
            weight += len(ds)

        dist.all_reduce(weight)
        new_sd = global_model.state_dict()
        for k in float_keys:
            dist.all_reduce(sums[k])
            new_sd[k].copy_(sums[k] / weight)

        if rank == 0 and rnd % 10 == 0:
            print(f"round {rnd} done in {time.time() - t0:.1f}s", flush=True)

        if (rnd + 1) % args.eval_every == 0:
            top1, top5 = evaluate(global_model, test_loader, device)
            if rank == 0:
                print(f"[round {rnd + 1}] top1 {top1:.4f} top5 {top5:.4f}", flush=True)
                os.makedirs(args.out, exist_ok=True)
                torch.save({"round": rnd + 1, "model": global_model.state_dict(),
                            "classes": species}, os.path.join(args.out, "global.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
