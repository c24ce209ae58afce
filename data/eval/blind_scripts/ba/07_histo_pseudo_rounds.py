"""Histopathologic Cancer Detection - fold training + test pseudo-labelling rounds.

round 0: 5-fold on train
round r>0: each fold starts from its round r-1 weights and trains on train + confident test pseudo labels
launch: torchrun --nproc_per_node=4 07_histo_pseudo_rounds.py --rounds 2
"""
import argparse
import os

import albumentations as A
import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from albumentations.pytorch import ToTensorV2
from PIL import Image
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/histopathologic-cancer-detection")
    ap.add_argument("--work", default="./work/histo_resnext")
    ap.add_argument("--arch", default="resnext50_32x4d")
    ap.add_argument("--n-folds", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--ft-epochs", type=int, default=3)
    ap.add_argument("--bs", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--pl-hi", type=float, default=0.97)
    ap.add_argument("--pl-lo", type=float, default=0.03)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


AUG = A.Compose([A.HorizontalFlip(), A.VerticalFlip(), A.RandomRotate90(),
                 A.RandomBrightnessContrast(0.1, 0.1), A.HueSaturationValue(5, 10, 5),
                 A.Normalize(), ToTensorV2()])
PLAIN = A.Compose([A.Normalize(), ToTensorV2()])


class PatchDS(Dataset):
    def __init__(self, paths, labels, tfm):
        self.paths, self.labels, self.tfm = list(paths), np.asarray(labels, dtype=np.float32), tfm

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = np.array(Image.open(self.paths[i]))
        return self.tfm(image=img)["image"], self.labels[i], i


def make_model(arch, pretrained):
    m = timm.create_model(arch, pretrained=pretrained, num_classes=1)
    return nn.SyncBatchNorm.convert_sync_batchnorm(m)


def load_weights(model, path):
    state = torch.load(path)
    model.load_state_dict(state)
    return model


@torch.no_grad()
def predict(model, ds, bs, device, tta=True):
    sampler = DistributedSampler(ds, shuffle=False)
    dl = DataLoader(ds, batch_size=bs, sampler=sampler, num_workers=6, pin_memory=True)
    model.eval()
    ids, ps = [], []
    for x, _, i in dl:
        x = x.to(device, non_blocking=True)
        with torch.cuda.amp.autocast():
            logit = model(x).float()
            if tta:
                logit = (logit + model(x.flip(2)).float() + model(x.flip(3)).float()) / 3
        ps.append(torch.sigmoid(logit).squeeze(1).cpu().numpy())
        ids.append(i.numpy())
    res = [None] * dist.get_world_size()
    dist.all_gather_object(res, (np.concatenate(ids), np.concatenate(ps)))
    out = np.empty(len(ds), dtype=np.float32)
    for i, p in res:
        out[i] = p
    return out


def fit(model, train_ds, val_ds, val_y, epochs, lr, args, device, local_rank, ckpt):
    rank = dist.get_rank()
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)
    ddp = DDP(model, device_ids=[local_rank])
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4, nesterov=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=epochs * len(dl), pct_start=0.2)
    scaler = torch.cuda.amp.GradScaler()
    crit = nn.BCEWithLogitsLoss()
    best = 0.0
    for ep in range(epochs):
        sampler.set_epoch(ep)
        ddp.train()
        for x, y, _ in dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.cuda.amp.autocast():
                loss = crit(ddp(x).squeeze(1), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
        p = predict(ddp.module, val_ds, args.bs * 2, device, tta=False)
        auc = roc_auc_score(val_y, p)
        if rank == 0:
            print(f"    ep {ep} val auc {auc:.5f}", flush=True)
            if auc > best:
                torch.save(ddp.module.state_dict(), ckpt)
        best = max(best, auc)
        dist.barrier()
    return best


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    if rank == 0:
        os.makedirs(args.work, exist_ok=True)
    dist.barrier()

    df = pd.read_csv(os.path.join(args.data, "train_folds.csv"))
    df["path"] = args.data + "/train/" + df.id + ".tif"
    sub = pd.read_csv(os.path.join(args.data, "sample_submission.csv"))
    test_paths = (args.data + "/test/" + sub.id + ".tif").values
    test_ds = PatchDS(test_paths, np.zeros(len(sub)), PLAIN)
    pseudo = None

    for rnd in range(args.rounds + 1):
        scores = []
        for fold in range(args.n_folds):
            trn, val = df[df.fold != fold], df[df.fold == fold]
            paths, labels = trn.path.values, trn.label.values
            if pseudo is not None:
                paths = np.concatenate([paths, pseudo.path.values])
                labels = np.concatenate([labels, pseudo.label.values])
            train_ds = PatchDS(paths, labels, AUG)
            val_ds = PatchDS(val.path.values, val.label.values, PLAIN)
            ckpt = os.path.join(args.work, f"r{rnd}_f{fold}.pth")

            model = make_model(args.arch, pretrained=(rnd == 0))
            if rnd > 0:
                load_weights(model, os.path.join(args.work, f"r{rnd - 1}_f{fold}.pth"))
            model = model.to(device)
            epochs = args.epochs if rnd == 0 else args.ft_epochs
            lr = args.lr if rnd == 0 else args.lr / 5
            if rank == 0:
                print(f"round {rnd} fold {fold}: {len(train_ds)} train ({0 if pseudo is None else len(pseudo)} pseudo)")
            scores.append(fit(model, train_ds, val_ds, val.label.values, epochs, lr, args, device, local_rank, ckpt))
            del model
            torch.cuda.empty_cache()
        if rank == 0:
            print(f"round {rnd} fold aucs {np.round(scores, 5)} mean {np.mean(scores):.5f}", flush=True)

        # fold-ensemble on test -> submission + next round's pseudo labels
        test_pred = np.zeros(len(sub), dtype=np.float32)
        for fold in range(args.n_folds):
            m = load_weights(make_model(args.arch, pretrained=False), os.path.join(args.work, f"r{rnd}_f{fold}.pth"))
            test_pred += predict(m.to(device), test_ds, args.bs * 2, device) / args.n_folds
            del m
        sel = (test_pred > args.pl_hi) | (test_pred < args.pl_lo)
        pseudo = pd.DataFrame({"path": test_paths[sel], "label": (test_pred[sel] > 0.5).astype(np.float32)})
        if rank == 0:
            sub.assign(label=test_pred).to_csv(os.path.join(args.work, f"submission_r{rnd}.csv"), index=False)
            print(f"round {rnd}: {sel.sum()} / {len(sel)} test patches kept as pseudo labels", flush=True)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
