"""DSMIL (dual-stream MIL, Li et al. CVPR 2021) for TCGA NSCLC subtyping (LUAD vs LUSC).

Bags are per-slide .pt files of SimCLR patch embeddings, written by compute_feats.py.
Cross-validation folds are patient-level and stored in folds.json.
"""
import argparse
import json
import os
import random
import sys
from datetime import datetime

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


parser = argparse.ArgumentParser(description="Train DSMIL on patch features")
parser.add_argument("--local_rank", type=int, default=0)
parser.add_argument("--dataset_csv", type=str, default="datasets/tcga-lung/slides.csv")
parser.add_argument("--feats_root", type=str, default="datasets/tcga-lung/feats")
parser.add_argument("--folds_json", type=str, default="datasets/tcga-lung/folds.json")
parser.add_argument("--fold", type=int, default=0)
parser.add_argument("--feats_size", type=int, default=512)
parser.add_argument("--num_classes", type=int, default=2)
parser.add_argument("--lr", type=float, default=2e-4)
parser.add_argument("--weight_decay", type=float, default=5e-3)
parser.add_argument("--num_epochs", type=int, default=100)
parser.add_argument("--dropout_patch", type=float, default=0.0)
parser.add_argument("--dropout_node", type=float, default=0.0)
parser.add_argument("--save_dir", type=str, default="weights")
parser.add_argument("--seed", type=int, default=0)


class BagDataset(Dataset):
    def __init__(self, records, feats_root, dropout_patch=0.0):
        self.records = records
        self.feats_root = feats_root
        self.dropout_patch = dropout_patch

    def __len__(self):
        return len(self.records)

    def __getitem__(self, idx):
        rec = self.records[idx]
        feats = torch.load(os.path.join(self.feats_root, rec["slide_id"] + ".pt"), map_location="cpu")
        if self.dropout_patch > 0:
            n_keep = max(1, int(feats.shape[0] * (1 - self.dropout_patch)))
            feats = feats[torch.randperm(feats.shape[0])[:n_keep]]
        return feats, torch.tensor(rec["label"], dtype=torch.long), rec["slide_id"]


class FCLayer(nn.Module):
    def __init__(self, in_size, out_size=1):
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(in_size, out_size))

    def forward(self, feats):
        return feats, self.fc(feats)


class BClassifier(nn.Module):
    def __init__(self, input_size, output_class, dropout_v=0.0, nonlinear=True, passing_v=False):
        super().__init__()
        if nonlinear:
            self.q = nn.Sequential(nn.Linear(input_size, 128), nn.ReLU(), nn.Linear(128, 128), nn.Tanh())
        else:
            self.q = nn.Linear(input_size, 128)
        if passing_v:
            self.v = nn.Sequential(nn.Dropout(dropout_v), nn.Linear(input_size, input_size), nn.ReLU())
        else:
            self.v = nn.Identity()
        self.fcc = nn.Conv1d(output_class, output_class, kernel_size=input_size)

    def forward(self, feats, c):
        device = feats.device
        V = self.v(feats)
        Q = self.q(feats).view(feats.shape[0], -1)
        _, m_indices = torch.sort(c, 0, descending=True)
        m_feats = torch.index_select(feats, dim=0, index=m_indices[0, :])
        q_max = self.q(m_feats)
        A = torch.mm(Q, q_max.transpose(0, 1))
        A = F.softmax(A / torch.sqrt(torch.tensor(Q.shape[1], dtype=torch.float32, device=device)), 0)
        B = torch.mm(A.transpose(0, 1), V)
        B = B.view(1, B.shape[0], B.shape[1])
        C = self.fcc(B).view(1, -1)
        return C, A, B


class MILNet(nn.Module):
    def __init__(self, i_classifier, b_classifier):
        super().__init__()
        self.i_classifier = i_classifier
        self.b_classifier = b_classifier

    def forward(self, x):
        feats, classes = self.i_classifier(x)
        prediction_bag, A, B = self.b_classifier(feats, classes)
        return classes, prediction_bag, A, B


def load_split(args):
    df = pd.read_csv(args.dataset_csv)
    with open(args.folds_json) as f:
        folds = json.load(f)
    test_cases = set(folds[str(args.fold)])
    to_rec = lambda d: [{"slide_id": r.slide_id, "label": int(r.label)} for r in d.itertuples()]
    train = to_rec(df[~df.case_id.isin(test_cases)])
    test = to_rec(df[df.case_id.isin(test_cases)])
    return train, test


def train_epoch(milnet, loader, optimizer, criterion, device):
    milnet.train()
    total = torch.zeros(2, device=device)
    for feats, label, _ in loader:
        feats = feats.squeeze(0).to(device, non_blocking=True)
        bag_label = F.one_hot(label, num_classes=2).float().to(device)
        ins_prediction, bag_prediction, _, _ = milnet(feats)
        max_prediction, _ = torch.max(ins_prediction, 0)
        bag_loss = criterion(bag_prediction.view(1, -1), bag_label.view(1, -1))
        max_loss = criterion(max_prediction.view(1, -1), bag_label.view(1, -1))
        loss = 0.5 * bag_loss + 0.5 * max_loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total[0] += loss.item()
        total[1] += 1
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return (total[0] / total[1]).item()


@torch.no_grad()
def test_epoch(net, loader, device, world_size):
    net.eval()
    local = []
    for feats, label, slide_id in loader:
        feats = feats.squeeze(0).to(device)
        ins_prediction, bag_prediction, _, _ = net(feats)
        max_prediction, _ = torch.max(ins_prediction, 0)
        score = 0.5 * torch.sigmoid(max_prediction) + 0.5 * torch.sigmoid(bag_prediction.squeeze(0))
        local.append((slide_id[0], score[1].item(), int(label)))
    parts = [None] * world_size
    dist.all_gather_object(parts, local)
    merged = {sid: (s, y) for part in parts for sid, s, y in part}
    scores = np.array([v[0] for v in merged.values()])
    labels = np.array([v[1] for v in merged.values()])
    auc = roc_auc_score(labels, scores)
    acc = float(((scores > 0.5).astype(int) == labels).mean())
    return auc, acc, len(merged)


def main():
    args = parser.parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    train_recs, test_recs = load_split(args)
    train_set = BagDataset(train_recs, args.feats_root, args.dropout_patch)
    test_set = BagDataset(test_recs, args.feats_root)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=1, sampler=train_sampler, num_workers=4, pin_memory=True)
    test_loader = DataLoader(test_set, batch_size=1, sampler=DistributedSampler(test_set, shuffle=False),
                             num_workers=4, pin_memory=True)

    i_classifier = FCLayer(in_size=args.feats_size, out_size=args.num_classes)
    b_classifier = BClassifier(input_size=args.feats_size, output_class=args.num_classes,
                               dropout_v=args.dropout_node, nonlinear=True)
    milnet = MILNet(i_classifier, b_classifier).to(device)
    milnet = DistributedDataParallel(milnet, device_ids=[args.local_rank], output_device=args.local_rank)

    criterion = nn.BCEWithLogitsLoss()
    optimizer = torch.optim.Adam(milnet.parameters(), lr=args.lr, betas=(0.5, 0.9), weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.num_epochs, 0.000005)

    save_path = os.path.join(args.save_dir, datetime.now().strftime("%Y%m%d-%H%M") + f"_fold{args.fold}")
    writer = None
    if rank == 0:
        os.makedirs(save_path, exist_ok=True)
        writer = SummaryWriter(save_path)
        print(f"train {len(train_set)} slides, test {len(test_set)} slides, world size {world_size}")

    best_auc = 0.0
    for epoch in range(1, args.num_epochs + 1):
        train_sampler.set_epoch(epoch)
        train_loss = train_epoch(milnet, train_loader, optimizer, criterion, device)
        auc, acc, n = test_epoch(milnet.module, test_loader, device, world_size)
        scheduler.step()
        if rank == 0:
            writer.add_scalar("train/loss", train_loss, epoch)
            writer.add_scalar("test/auc", auc, epoch)
            writer.add_scalar("test/acc", acc, epoch)
            sys.stdout.write(f"\r Epoch [{epoch}/{args.num_epochs}] train loss: {train_loss:.4f} "
                             f"test acc: {acc:.4f}, auc: {auc:.4f} ({n} slides)\n")
            if auc >= best_auc:
                best_auc = auc
                torch.save(milnet.module.state_dict(), os.path.join(save_path, "best.pth"))
                print(f"Best model saved at: {save_path}/best.pth")
        dist.barrier()

    if rank == 0:
        writer.close()
        with open(os.path.join(save_path, "result.json"), "w") as f:
            json.dump({"fold": args.fold, "best_auc": best_auc}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
