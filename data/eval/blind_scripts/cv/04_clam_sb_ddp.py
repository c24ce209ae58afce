"""CLAM-SB (Lu et al. 2021) on Camelyon16 (normal vs tumor), multi-GPU with DDP.

Bag-level CE + instance-level clustering loss on the top/bottom-k attended patches.
Features: <data_root>/pt_files/<slide_id>.pt  (ResNet50-trunc, 1024-d)
Splits:   <split_dir>/splits_<k>.csv          (patient-level, from create_splits_seq.py)
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
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

try:
    from topk.svm import SmoothTop1SVM
except ImportError:  # smooth-topk not installed
    SmoothTop1SVM = None


def get_args():
    parser = argparse.ArgumentParser("CLAM-SB DDP")
    parser.add_argument("--data_root", required=True)
    parser.add_argument("--csv_path", default="dataset_csv/camelyon16.csv")
    parser.add_argument("--split_dir", default="splits/camelyon16_100")
    parser.add_argument("--k_start", type=int, default=0)
    parser.add_argument("--k_end", type=int, default=10)
    parser.add_argument("--results_dir", default="results/clam_sb_c16")
    parser.add_argument("--max_epochs", type=int, default=200)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--reg", type=float, default=1e-5)
    parser.add_argument("--bag_weight", type=float, default=0.7)
    parser.add_argument("--B", type=int, default=8, help="number of positive/negative patches to sample")
    parser.add_argument("--inst_loss", choices=["svm", "ce"], default="svm")
    parser.add_argument("--drop_out", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=1)
    return parser.parse_args()


class Attn_Net_Gated(nn.Module):
    def __init__(self, L=512, D=256, dropout=0.25, n_classes=1):
        super().__init__()
        self.attention_a = nn.Sequential(nn.Linear(L, D), nn.Tanh(), nn.Dropout(dropout))
        self.attention_b = nn.Sequential(nn.Linear(L, D), nn.Sigmoid(), nn.Dropout(dropout))
        self.attention_c = nn.Linear(D, n_classes)

    def forward(self, x):
        A = self.attention_c(self.attention_a(x) * self.attention_b(x))
        return A, x


class CLAM_SB(nn.Module):
    def __init__(self, in_dim=1024, n_classes=2, dropout=0.25, k_sample=8, subtyping=False, instance_loss_fn=None):
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(in_dim, 512), nn.ReLU(), nn.Dropout(dropout))
        self.attention_net = Attn_Net_Gated(L=512, D=256, dropout=dropout, n_classes=1)
        self.classifiers = nn.Linear(512, n_classes)
        self.instance_classifiers = nn.ModuleList([nn.Linear(512, 2) for _ in range(n_classes)])
        self.k_sample = k_sample
        self.n_classes = n_classes
        self.subtyping = subtyping
        self.instance_loss_fn = instance_loss_fn or nn.CrossEntropyLoss()

    @staticmethod
    def create_positive_targets(length, device):
        return torch.full((length,), 1, device=device).long()

    @staticmethod
    def create_negative_targets(length, device):
        return torch.full((length,), 0, device=device).long()

    def inst_eval(self, A, h, classifier):
        device = h.device
        top_p_ids = torch.topk(A, self.k_sample)[1][-1]
        top_p = torch.index_select(h, dim=0, index=top_p_ids)
        top_n_ids = torch.topk(-A, self.k_sample, dim=1)[1][-1]
        top_n = torch.index_select(h, dim=0, index=top_n_ids)
        p_targets = self.create_positive_targets(self.k_sample, device)
        n_targets = self.create_negative_targets(self.k_sample, device)
        all_targets = torch.cat([p_targets, n_targets], dim=0)
        all_instances = torch.cat([top_p, top_n], dim=0)
        logits = classifier(all_instances)
        return self.instance_loss_fn(logits, all_targets)

    def inst_eval_out(self, A, h, classifier):
        device = h.device
        top_p_ids = torch.topk(A, self.k_sample)[1][-1]
        top_p = torch.index_select(h, dim=0, index=top_p_ids)
        p_targets = self.create_negative_targets(self.k_sample, device)
        logits = classifier(top_p)
        return self.instance_loss_fn(logits, p_targets)

    def forward(self, h, label=None, instance_eval=False):
        h = self.fc(h)
        A, h = self.attention_net(h)        # N x 1
        A = torch.transpose(A, 1, 0)        # 1 x N
        A = F.softmax(A, dim=1)
        total_inst_loss = 0.0
        if instance_eval:
            inst_labels = F.one_hot(label, num_classes=self.n_classes).squeeze()
            for i in range(len(self.instance_classifiers)):
                classifier = self.instance_classifiers[i]
                if inst_labels[i].item() == 1:
                    total_inst_loss = total_inst_loss + self.inst_eval(A, h, classifier)
                elif self.subtyping:
                    total_inst_loss = total_inst_loss + self.inst_eval_out(A, h, classifier)
            if self.subtyping:
                total_inst_loss = total_inst_loss / len(self.instance_classifiers)
        M = torch.mm(A, h)
        logits = self.classifiers(M)
        return logits, A, total_inst_loss


class Generic_MIL_Dataset(Dataset):
    def __init__(self, slide_data, data_root):
        self.slide_data = slide_data.reset_index(drop=True)
        self.data_root = data_root

    def __len__(self):
        return len(self.slide_data)

    def __getitem__(self, idx):
        slide_id = self.slide_data["slide_id"][idx]
        label = int(self.slide_data["label"][idx])
        features = torch.load(os.path.join(self.data_root, "pt_files", f"{slide_id}.pt"), map_location="cpu")
        return features, label, idx


def init_distributed():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return dist.get_rank(), dist.get_world_size(), local_rank


@torch.no_grad()
def summary(model, loader, device, world_size):
    model.eval()
    rows = []
    for data, label, idx in loader:
        logits, _, _ = model(data[0].to(device))
        rows.append((int(idx), float(F.softmax(logits, dim=1)[0, 1]), int(label)))
    gathered = [None] * world_size
    dist.all_gather_object(gathered, rows)
    uniq = {i: (p, y) for part in gathered for i, p, y in part}
    probs = np.array([p for p, _ in uniq.values()])
    labels = np.array([y for _, y in uniq.values()])
    return roc_auc_score(labels, probs), float(((probs > 0.5) == labels).mean())


def train_fold(fold, args, df, rank, world_size, local_rank):
    device = torch.device("cuda", local_rank)
    split = pd.read_csv(os.path.join(args.split_dir, f"splits_{fold}.csv"))
    parts = {k: df[df.slide_id.isin(split[k].dropna())] for k in ("train", "val", "test")}
    datasets = {k: Generic_MIL_Dataset(v, args.data_root) for k, v in parts.items()}
    samplers = {k: DistributedSampler(ds, shuffle=(k == "train"), seed=args.seed) for k, ds in datasets.items()}
    loaders = {k: DataLoader(ds, batch_size=1, sampler=samplers[k], num_workers=4, pin_memory=True)
               for k, ds in datasets.items()}

    if args.inst_loss == "svm" and SmoothTop1SVM is not None:
        instance_loss_fn = SmoothTop1SVM(n_classes=2).cuda(local_rank)
    else:
        instance_loss_fn = nn.CrossEntropyLoss()
    model = CLAM_SB(n_classes=2, dropout=args.drop_out, k_sample=args.B, subtyping=False,
                    instance_loss_fn=instance_loss_fn).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(filter(lambda p: p.requires_grad, model.parameters()), lr=args.lr,
                                 weight_decay=args.reg)
    loss_fn = nn.CrossEntropyLoss()

    ckpt = os.path.join(args.results_dir, f"s_{fold}_checkpoint.pt")
    best_val = -1.0
    for epoch in range(args.max_epochs):
        samplers["train"].set_epoch(epoch)
        model.train()
        t0 = time.time()
        meter = torch.zeros(3, device=device)
        for data, label, _ in loaders["train"]:
            data, label = data[0].to(device, non_blocking=True), label.to(device)
            logits, _, inst_loss = model(data, label=label, instance_eval=True)
            loss = args.bag_weight * loss_fn(logits, label) + (1 - args.bag_weight) * inst_loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            meter += torch.tensor([loss.item(), float(inst_loss), 1.0], device=device)
        dist.all_reduce(meter)
        val_auc, val_acc = summary(model.module, loaders["val"], device, world_size)
        if rank == 0:
            print(f"[fold {fold}] epoch {epoch}: loss {meter[0] / meter[2]:.4f} inst {meter[1] / meter[2]:.4f} "
                  f"val auc {val_auc:.4f} acc {val_acc:.4f} ({time.time() - t0:.1f}s)", flush=True)
            if val_auc > best_val:
                best_val = val_auc
                torch.save(model.module.state_dict(), ckpt)
        dist.barrier()

    model.module.load_state_dict(torch.load(ckpt, map_location=device))
    test_auc, test_acc = summary(model.module, loaders["test"], device, world_size)
    return best_val, test_auc, test_acc


def main():
    args = get_args()
    rank, world_size, local_rank = init_distributed()
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    df = pd.read_csv(args.csv_path)
    df["label"] = df["label"].map({"normal_tissue": 0, "tumor_tissue": 1})
    if rank == 0:
        os.makedirs(args.results_dir, exist_ok=True)
    dist.barrier()

    rows = []
    for fold in range(args.k_start, args.k_end):
        val_auc, test_auc, test_acc = train_fold(fold, args, df, rank, world_size, local_rank)
        rows.append({"folds": fold, "val_auc": val_auc, "test_auc": test_auc, "test_acc": test_acc})
        if rank == 0:
            print(f"fold {fold}: test auc {test_auc:.4f}, acc {test_acc:.4f}")
    if rank == 0:
        pd.DataFrame(rows).to_csv(os.path.join(args.results_dir, "summary.csv"), index=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
