"""
Stage-2 fine-tune with SWA for the plant-pathology model.
Loads the stage-1 fold checkpoint, trains a few more epochs with SWALR and averages the weights.

    torchrun --nproc_per_node=4 14_swa_finetune.py --fold 2 \
        --init weights/stage1/seresnext50_32x4d_f2.pth --wandb
"""
import os
import time
import argparse
import itertools

import numpy as np
import pandas as pd
import cv2
import torch
import torch.nn as nn
import torch.distributed as dist
from torch.utils.data import Dataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel, SWALR
import albumentations as A
from albumentations.pytorch import ToTensorV2
from sklearn.metrics import roc_auc_score
import timm

LABELS = ["healthy", "multiple_diseases", "rust", "scab"]


def cli():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/plant-pathology-2020")
    ap.add_argument("--fold", type=int, default=0)
    ap.add_argument("--arch", default="seresnext50_32x4d")
    ap.add_argument("--init", required=True)
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--swa_start", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--swa_lr", type=float, default=5e-5)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--bn_batches", type=int, default=300)
    ap.add_argument("--out", default="weights/stage2_swa")
    ap.add_argument("--wandb", action="store_true")
    return ap.parse_args()


class LeafDS(Dataset):
    def __init__(self, df, root, train):
        self.df = df.reset_index(drop=True)
        self.root = root
        aug = [A.RandomResizedCrop(512, 512, scale=(0.6, 1.0)), A.Flip(),
               A.ShiftScaleRotate(p=0.5), A.RandomBrightnessContrast(p=0.5)] if train else \
              [A.Resize(512, 512)]
        self.tf = A.Compose(aug + [A.Normalize(), ToTensorV2()])

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        r = self.df.iloc[i]
        img = cv2.cvtColor(cv2.imread(f"{self.root}/images/{r.image_id}.jpg"), cv2.COLOR_BGR2RGB)
        return self.tf(image=img)["image"], r[LABELS].values.argmax(), i


@torch.no_grad()
def dist_eval(net, loader, labels, device):
    net.eval()
    P, I = [], []
    for x, _, i in loader:
        with torch.cuda.amp.autocast():
            P.append(net(x.to(device)).softmax(1).float().cpu().numpy())
        I.append(i.numpy())
    allr = [None] * dist.get_world_size()
    dist.all_gather_object(allr, (np.concatenate(P), np.concatenate(I)))
    P = np.concatenate([a[0] for a in allr])
    I = np.concatenate([a[1] for a in allr])
    I, k = np.unique(I, return_index=True)
    return roc_auc_score(labels[I], P[k], average="macro")


@torch.no_grad()
def bn_update(loader, model, device, max_batches):
    momenta = {}
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.reset_running_stats()
            momenta[m] = m.momentum
            m.momentum = None  # cumulative average
    if not momenta:
        return
    was_training = model.training
    model.train()
    for x, _, _ in itertools.islice(loader, max_batches):
        model(x.to(device))
    for m, mom in momenta.items():
        m.momentum = mom
    model.train(was_training)


def main():
    a = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    run = None
    if a.wandb and rank == 0:
        import wandb
        run = wandb.init(project="plant-pathology", group="stage2-swa",
                         name=f"{a.arch}-f{a.fold}", config=vars(a))

    df = pd.read_csv(f"{a.root}/train_folds.csv")
    tr, va = df[df.fold != a.fold], df[df.fold == a.fold].reset_index(drop=True)
    ds_tr, ds_va = LeafDS(tr, a.root, True), LeafDS(va, a.root, False)
    s_tr = DistributedSampler(ds_tr, shuffle=True, seed=a.fold)
    s_va = DistributedSampler(ds_va, shuffle=False)
    dl_tr = DataLoader(ds_tr, a.bs, sampler=s_tr, num_workers=6, pin_memory=True, drop_last=True)
    dl_va = DataLoader(ds_va, a.bs * 2, sampler=s_va, num_workers=6, pin_memory=True)
    y_va = va[LABELS].values

    net = timm.create_model(a.arch, pretrained=False, num_classes=len(LABELS))
    sd = torch.load(a.init, map_location="cpu")
    sd = {k.replace("module.", "", 1) if k.startswith("module.") else k: v for k, v in sd.items()}
    net.load_state_dict(sd)
    net.to(dev)
    swa_net = AveragedModel(net)
    model = DDP(net, device_ids=[local_rank])

    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=1e-4)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=a.swa_start)
    swa_sched = SWALR(opt, swa_lr=a.swa_lr, anneal_epochs=1, anneal_strategy="cos")
    scaler = torch.cuda.amp.GradScaler()
    crit = nn.CrossEntropyLoss(label_smoothing=0.05)

    for ep in range(a.epochs):
        s_tr.set_epoch(ep)
        model.train()
        t0 = time.time()
        tl = torch.zeros(2, device=dev)
        for x, y, _ in dl_tr:
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            with torch.cuda.amp.autocast():
                loss = crit(model(x), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            tl += torch.stack([loss.detach() * x.size(0), torch.tensor(float(x.size(0)), device=dev)])
        if ep >= a.swa_start:
            swa_net.update_parameters(net)
            swa_sched.step()
        else:
            cos.step()
        dist.all_reduce(tl)
        auc = dist_eval(net, dl_va, y_va, dev)
        if rank == 0:
            lr_now = opt.param_groups[0]["lr"]
            print(f"ep {ep} loss {(tl[0] / tl[1]).item():.4f} auc {auc:.4f} lr {lr_now:.2e} "
                  f"{time.time() - t0:.0f}s", flush=True)
            if run is not None:
                run.log({"epoch": ep, "loss": (tl[0] / tl[1]).item(), "val_auc": auc,
                         "lr": lr_now})

    # BN statistics for the averaged weights. Every rank runs the same un-augmented batches in the
    # same order, so all copies of swa_net end up identical and can be scored together.
    g = torch.Generator()
    g.manual_seed(1234)
    bn_loader = DataLoader(LeafDS(tr, a.root, False), a.bs, shuffle=True, generator=g,
                           num_workers=6, pin_memory=True)
    bn_update(bn_loader, swa_net, dev, a.bn_batches)
    swa_auc = dist_eval(swa_net.module, dl_va, y_va, dev)
    if rank == 0:
        os.makedirs(a.out, exist_ok=True)
        torch.save(swa_net.module.state_dict(), f"{a.out}/{a.arch}_swa_f{a.fold}.pth")
        print(f"fold {a.fold} SWA auc {swa_auc:.4f}", flush=True)
        if run is not None:
            run.summary["swa_auc"] = swa_auc
            run.finish()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
