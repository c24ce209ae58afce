"""Cross-subject motor imagery decoding (BCI Competition IV 2a, 4 classes) with EEGNet-8,2
and a subject-adversarial branch (gradient reversal) that is switched on after a warm-up.

Leave-one-subject-out: --fold k holds out subject k+1 (both sessions) for testing; the
evaluation session of one other subject serves as validation.

Training uses 2 s crops sliding over the 4 s trials; evaluation averages the crop
probabilities of a trial.

Start (spawns one process per visible GPU):
    python 06_eegnet_motor_imagery.py --data_dir /data/bciciv2a --fold 4 --gpus 4
"""
import argparse
import os
import socket

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import cohen_kappa_score, f1_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

N_SUBJECTS = 9


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", required=True)
    p.add_argument("--out_dir", default="results/eegnet_adv")
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--crop", type=int, default=500)
    p.add_argument("--crop_stride", type=int, default=50)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--adv_start", type=int, default=30, help="epoch at which the subject branch is switched on")
    p.add_argument("--adv_weight", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--patience", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def load_subject(data_dir, subj, session):
    d = np.load(os.path.join(data_dir, f"A{subj:02d}{session}.npz"))
    x = d["x"].astype(np.float32)  # [trials, 22, 1000], 250 Hz, band-passed 4-38 Hz
    x = (x - x.mean(axis=(0, 2), keepdims=True)) / (x.std(axis=(0, 2), keepdims=True) + 1e-6)
    return x, d["y"].astype(np.int64)


class CropDataset(Dataset):
    def __init__(self, xs, ys, subj_ids, crop, stride):
        self.x, self.y, self.s = xs, ys, subj_ids
        T = xs.shape[-1]
        starts = np.arange(0, T - crop + 1, stride)
        self.index = [(t, s) for t in range(len(xs)) for s in starts]
        self.crop = crop

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        t, s = self.index[i]
        return torch.from_numpy(self.x[t, :, s:s + self.crop]), self.y[t], self.s[t]


class GradReverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, lam):
        ctx.lam = lam
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -ctx.lam * g, None


class EEGNet(nn.Module):
    def __init__(self, n_ch=22, n_classes=4, n_subjects=N_SUBJECTS, F1=8, D=2, F2=16, drop=0.25):
        super().__init__()
        self.block1 = nn.Sequential(
            nn.Conv2d(1, F1, (1, 64), padding=(0, 32), bias=False), nn.BatchNorm2d(F1),
            nn.Conv2d(F1, F1 * D, (n_ch, 1), groups=F1, bias=False), nn.BatchNorm2d(F1 * D), nn.ELU(),
            nn.AvgPool2d((1, 4)), nn.Dropout(drop),
        )
        self.block2 = nn.Sequential(
            nn.Conv2d(F1 * D, F1 * D, (1, 16), padding=(0, 8), groups=F1 * D, bias=False),
            nn.Conv2d(F1 * D, F2, 1, bias=False), nn.BatchNorm2d(F2), nn.ELU(),
            nn.AvgPool2d((1, 8)), nn.Dropout(drop), nn.AdaptiveAvgPool2d((1, 8)), nn.Flatten(),
        )
        self.classifier = nn.Linear(F2 * 8, n_classes)
        self.subject_head = nn.Sequential(nn.Linear(F2 * 8, 64), nn.ELU(), nn.Linear(64, n_subjects))

    def forward(self, x, adv_lambda=None):
        z = self.block2(self.block1(x.unsqueeze(1)))
        logits = self.classifier(z)
        if adv_lambda is None:
            return logits
        return logits, self.subject_head(GradReverse.apply(z, adv_lambda))


@torch.no_grad()
def evaluate(net, x, y, rank, world, crop, stride, device):
    """Trial-level evaluation; trials are split rank-strided and results gathered as python objects."""
    net.eval()
    mine = np.arange(len(x))[rank::world]
    probs = []
    for t in mine:
        trial = torch.from_numpy(x[t]).to(device)
        crops = trial.unfold(-1, crop, stride).permute(1, 0, 2)  # [n_crops, ch, crop]
        probs.append(F.softmax(net(crops), dim=1).mean(0).cpu().numpy())
    gathered = [None] * world
    dist.all_gather_object(gathered, (mine.tolist(), probs))
    order = np.concatenate([np.asarray(g[0], dtype=np.int64) for g in gathered])
    P = np.concatenate([np.stack(g[1]) for g in gathered if len(g[1])])[np.argsort(order)]
    pred = P.argmax(1)
    return {
        "acc": float((pred == y).mean()),
        "kappa": float(cohen_kappa_score(y, pred)),
        "f1": float(f1_score(y, pred, average="macro")),
        "auroc": float(roc_auc_score(y, P, multi_class="ovr")),
    }


def worker(rank, world_size, args, port):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)

    test_subj = args.fold + 1
    val_subj = test_subj % N_SUBJECTS + 1
    train_subjects = [s for s in range(1, N_SUBJECTS + 1) if s != test_subj]
    xs, ys, ss = [], [], []
    for i, s in enumerate(train_subjects):
        for sess in ("T", "E"):
            if s == val_subj and sess == "E":
                continue
            x, y = load_subject(args.data_dir, s, sess)
            xs.append(x), ys.append(y), ss.append(np.full(len(y), i))
    train_ds = CropDataset(np.concatenate(xs), np.concatenate(ys), np.concatenate(ss), args.crop, args.crop_stride)
    val_x, val_y = load_subject(args.data_dir, val_subj, "E")
    test_x, test_y = map(np.concatenate, zip(*[load_subject(args.data_dir, test_subj, s) for s in ("T", "E")]))

    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    net = EEGNet(n_subjects=len(train_subjects))
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    # the subject head takes no part in the loss before --adv_start
    model = DDP(net, device_ids=[rank], find_unused_parameters=True)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    out_dir = os.path.join(args.out_dir, f"subject{test_subj:02d}")
    best_path = os.path.join(out_dir, "best.pt")
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
    best_kappa, since_best = -1.0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        adv_on = epoch >= args.adv_start
        # DANN schedule for the reversal strength
        p = max(0.0, (epoch - args.adv_start) / max(1, args.epochs - args.adv_start))
        lam = args.adv_weight * (2.0 / (1.0 + np.exp(-10 * p)) - 1.0)
        stats = torch.zeros(3, device=device)
        for x, y, s in loader:
            x, y, s = x.to(device, non_blocking=True), y.to(device, non_blocking=True), s.to(device, non_blocking=True)
            if adv_on:
                logits, subj_logits = model(x, adv_lambda=lam)
                loss = F.cross_entropy(logits, y) + F.cross_entropy(subj_logits, s)
            else:
                logits = model(x)
                loss = F.cross_entropy(logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            with torch.no_grad():  # max-norm constraint on the classifier, as in the EEGNet paper
                net.classifier.weight.copy_(torch.renorm(net.classifier.weight, 2, 0, 0.25))
            stats += torch.stack([loss.detach() * len(y), (logits.argmax(1) == y).sum().float(),
                                  torch.tensor(float(len(y)), device=device)])
        sched.step()
        dist.all_reduce(stats)

        val = evaluate(net, val_x, val_y, rank, world_size, args.crop, args.crop_stride, device)
        if rank == 0:
            print(f"[S{test_subj:02d}] ep {epoch:3d} adv={int(adv_on)} loss {stats[0] / stats[2]:.4f} "
                  f"train acc {stats[1] / stats[2]:.3f} | val acc {val['acc']:.3f} kappa {val['kappa']:.3f}",
                  flush=True)
        if val["kappa"] > best_kappa:
            best_kappa, since_best = val["kappa"], 0
            if rank == 0:
                torch.save(net.state_dict(), best_path)
        else:
            since_best += 1
        if since_best >= args.patience and epoch >= args.adv_start:
            break

    dist.barrier()
    net.load_state_dict(torch.load(best_path, map_location=device))
    test = evaluate(net, test_x, test_y, rank, world_size, args.crop, args.crop_stride, device)
    if rank == 0:
        print(f"[S{test_subj:02d}] TEST acc {test['acc']:.4f} kappa {test['kappa']:.4f} "
              f"F1 {test['f1']:.4f} AUROC {test['auroc']:.4f}")
        with open(os.path.join(out_dir, "test.txt"), "w") as f:
            f.write(repr(test) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse_args()
    mp.spawn(worker, args=(args.gpus, args, free_port()), nprocs=args.gpus, join=True)
