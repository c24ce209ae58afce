"""Fine-tune a contrastively pre-trained 12-lead ECG encoder on Chapman-Shaoxing rhythm classes
(SB, AFIB/AFL, GSVT, SR) with an L2-SP regulariser towards the pre-trained weights.

Input: {data_dir}/chapman_500hz.h5 with datasets ecg [N, 12, 5000] and rhythm [N] and
patient [N]. Windows of 2.5 s (1250 samples) are cut with 50 % overlap; a record's prediction
is the mean over its windows. Patient-wise k-fold; --fold selects the test patients.

    torchrun --nproc_per_node=8 17_chapman_ecg_finetune.py --data_dir /data/chapman \
        --pretrained ckpt/clocs_encoder.pt --fold 0
"""
import argparse
import os

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import f1_score, roc_auc_score
from sklearn.model_selection import GroupKFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

CLASSES = ["SB", "AFIB", "GSVT", "SR"]
WIN, HOP = 1250, 625


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", required=True)
    p.add_argument("--pretrained", required=True)
    p.add_argument("--out_dir", default="finetune/chapman")
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--n_folds", type=int, default=5)
    p.add_argument("--batch_size", type=int, default=128)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr_head", type=float, default=1e-3)
    p.add_argument("--lr_encoder", type=float, default=1e-4)
    p.add_argument("--l2sp_alpha", type=float, default=1e-3)
    p.add_argument("--patience", type=int, default=5)
    p.add_argument("--seed", type=int, default=21)
    return p.parse_args()


class WindowSet(Dataset):
    """All 50 %-overlap windows of the given records; remembers which record each came from."""

    def __init__(self, ecg, labels, records):
        self.ecg, self.labels = ecg, labels
        self.items = [(r, s) for r in records for s in range(0, ecg.shape[-1] - WIN + 1, HOP)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        r, s = self.items[i]
        return torch.from_numpy(self.ecg[r, :, s:s + WIN]), int(self.labels[r]), r, i


class Encoder(nn.Module):
    """Same architecture as in pre-training (4 conv blocks, 256-d embedding)."""

    def __init__(self, in_ch=12, dim=256):
        super().__init__()
        chans = [in_ch, 32, 64, 128, dim]
        blocks = []
        for a, b in zip(chans[:-1], chans[1:]):
            blocks += [nn.Conv1d(a, b, 7, padding=3), nn.GroupNorm(8, b), nn.GELU(), nn.MaxPool1d(3)]
        self.net = nn.Sequential(*blocks)
        self.dim = dim

    def forward(self, x):
        return self.net(x).mean(-1)


class FineTuner(nn.Module):
    def __init__(self, encoder, n_classes):
        super().__init__()
        self.encoder = encoder
        self.head = nn.Sequential(nn.Dropout(0.2), nn.Linear(encoder.dim, n_classes))
        self.anchor = None

    def set_anchor(self):
        # starting point of the encoder, used by the L2-SP penalty
        self.anchor = [p.detach().clone() for p in self.encoder.parameters()]

    def l2sp_penalty(self):
        return sum(((p - a) ** 2).sum() for p, a in zip(self.encoder.parameters(), self.anchor))

    def forward(self, x):
        return self.head(self.encoder(x))


@torch.no_grad()
def record_level_eval(model, loader, device):
    """Window probabilities are scattered into a [n_windows, C] buffer and all-reduced together with a
    per-window count, so the duplicates DistributedSampler pads with are averaged out exactly."""
    model.eval()
    ds = loader.dataset
    win_prob = torch.zeros(len(ds), len(CLASSES), device=device)
    win_cnt = torch.zeros(len(ds), device=device)
    for x, _, _, idx in loader:
        idx = idx.to(device, non_blocking=True)
        win_prob.index_add_(0, idx, F.softmax(model(x.to(device, non_blocking=True)), -1))
        win_cnt.index_add_(0, idx, torch.ones_like(idx, dtype=torch.float))
    dist.all_reduce(win_prob)
    dist.all_reduce(win_cnt)
    win_prob = (win_prob / win_cnt.clamp(min=1)[:, None]).cpu().numpy()
    rec_of_window = np.array([r for r, _ in ds.items])
    records, inv = np.unique(rec_of_window, return_inverse=True)
    probs = np.zeros((len(records), len(CLASSES)))
    np.add.at(probs, inv, win_prob)
    probs /= np.bincount(inv)[:, None]
    y = ds.labels[records]
    return {"macro_f1": f1_score(y, probs.argmax(1), average="macro"),
            "auroc": roc_auc_score(y, probs, multi_class="ovr", average="macro")}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    with h5py.File(os.path.join(args.data_dir, "chapman_500hz.h5"), "r") as f:
        ecg = f["ecg"][:].astype(np.float32)
        rhythm = f["rhythm"][:].astype(np.int64)
        patient = f["patient"][:]
    ecg = (ecg - ecg.mean(-1, keepdims=True)) / (ecg.std(-1, keepdims=True) + 1e-6)
    folds = list(GroupKFold(args.n_folds).split(ecg, rhythm, patient))
    trval, test = folds[args.fold]
    val = np.intersect1d(folds[(args.fold + 1) % args.n_folds][1], trval)
    train = np.setdiff1d(trval, val)

    train_ds, val_ds, test_ds = WindowSet(ecg, rhythm, train), WindowSet(ecg, rhythm, val), WindowSet(ecg, rhythm, test)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, 512, sampler=DistributedSampler(val_ds, shuffle=False), num_workers=4)
    test_dl = DataLoader(test_ds, 512, sampler=DistributedSampler(test_ds, shuffle=False), num_workers=4)

    encoder = Encoder()
    state = torch.load(args.pretrained, map_location="cpu")
    missing, unexpected = encoder.load_state_dict(state["encoder"], strict=False)
    if rank == 0:
        print(f"loaded {args.pretrained}: missing {missing} unexpected {unexpected}")
    net = FineTuner(encoder, len(CLASSES)).to(device)
    net.set_anchor()
    optimizer = torch.optim.AdamW([
        {"params": net.encoder.parameters(), "lr": args.lr_encoder, "weight_decay": 0.0},
        {"params": net.head.parameters(), "lr": args.lr_head, "weight_decay": 1e-2},
    ])
    model = DDP(net, device_ids=[local_rank])
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train_dl))
    counts = np.bincount(rhythm[train], minlength=len(CLASSES))
    criterion = nn.CrossEntropyLoss(weight=torch.tensor(counts.sum() / (len(CLASSES) * counts), dtype=torch.float32,
                                                        device=device))

    os.makedirs(args.out_dir, exist_ok=True)
    best_file = os.path.join(args.out_dir, f"fold{args.fold}_best.pt")
    best, bad = 0.0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y, _, _ in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)
            loss = criterion(logits, y) + args.l2sp_alpha * model.l2sp_penalty()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
        m = record_level_eval(model, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch:02d} loss {loss.item():.4f} val F1 {m['macro_f1']:.4f} AUROC {m['auroc']:.4f}",
                  flush=True)
        if m["macro_f1"] > best:
            best, bad = m["macro_f1"], 0
            if rank == 0:
                torch.save(net.state_dict(), best_file)
        else:
            bad += 1
            if bad >= args.patience:
                break

    dist.barrier()
    net.load_state_dict(torch.load(best_file, map_location=device))
    m = record_level_eval(model, test_dl, device)
    if rank == 0:
        print(f"fold {args.fold} TEST record-level macro F1 {m['macro_f1']:.4f} AUROC {m['auroc']:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
