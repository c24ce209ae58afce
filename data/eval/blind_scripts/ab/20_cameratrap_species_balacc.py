"""Camera-trap species classifier (EfficientNetV2-M) with an auxiliary
empty-frame head.  Model selection and early stopping use balanced accuracy
(mean per-class recall), since a handful of species dominate the data.

    torchrun --nnodes=1 --nproc_per_node=8 --max-restarts=3 20_cameratrap_species_balacc.py \
        --meta /data/ct/meta_v5.csv --images /data/ct/crops --out /nfs/ct/runs/effv2m_v5
"""
import argparse
import logging
import os
import time
from collections import defaultdict

import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--meta", required=True)
    p.add_argument("--images", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--bs", type=int, default=48)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--patience", type=int, default=5)
    p.add_argument("--empty-weight", type=float, default=0.3)
    p.add_argument("--profile", action="store_true")
    return p.parse_args()


class CameraTrap(Dataset):
    def __init__(self, df, root, train):
        self.paths = df["file"].tolist()
        self.species = df["species_id"].tolist()
        self.empty = df["is_empty"].astype("float32").tolist()
        self.root = root
        norm = transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
        self.tf = transforms.Compose(
            [transforms.RandomResizedCrop(384, scale=(0.4, 1.0)), transforms.RandomHorizontalFlip(),
             transforms.ColorJitter(0.2, 0.2, 0.1), transforms.ToTensor(), norm] if train else
            [transforms.Resize(416), transforms.CenterCrop(384), transforms.ToTensor(), norm])

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.root, self.paths[i])).convert("RGB")
        return self.tf(img), self.species[i], self.empty[i]


class SpeciesNet(nn.Module):
    def __init__(self, n_species):
        super().__init__()
        self.backbone = timm.create_model("tf_efficientnetv2_m.in21k_ft_in1k", pretrained=True,
                                          num_classes=0, drop_path_rate=0.2)
        d = self.backbone.num_features
        self.species_head = nn.Linear(d, n_species)
        self.empty_head = nn.Linear(d, 1)

    def forward(self, x):
        f = self.backbone(x)
        return self.species_head(f), self.empty_head(f).squeeze(-1)


@torch.no_grad()
def balanced_accuracy(model, loader, device):
    net = model.module
    net.eval()
    per_class = defaultdict(lambda: [0, 0])  # species -> [hits, total]
    for x, y, _ in loader:
        x = x.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits, _ = net(x)
        pred = logits.argmax(1).cpu()
        for t, p in zip(y.tolist(), pred.tolist()):
            per_class[t][0] += int(t == p)
            per_class[t][1] += 1
    classes = sorted(per_class)
    counts = torch.tensor([per_class[c] for c in classes], dtype=torch.float64, device=device)
    dist.all_reduce(counts)
    net.train()
    recall = counts[:, 0] / counts[:, 1].clamp(min=1)
    return recall.mean().item(), dict(zip(classes, recall.tolist()))


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    logging.basicConfig(filename=os.path.join(args.out, "logs", f"rank{rank}.log"), level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(message)s")
    log = logging.getLogger(__name__)
    if rank == 0:
        log.addHandler(logging.StreamHandler())

    meta = pd.read_csv(args.meta)
    # location-based split is precomputed in the metadata, identical on every rank
    train_df = meta[meta["split"] == "train"].reset_index(drop=True)
    val_df = meta[meta["split"] == "val"].reset_index(drop=True)
    n_species = int(meta["species_id"].max()) + 1

    train_ds, val_ds = CameraTrap(train_df, args.images, True), CameraTrap(val_df, args.images, False)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=5, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=10,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=96,
                        num_workers=8, pin_memory=True)

    model = DDP(SpeciesNet(n_species).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.02)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * len(train_dl),
                                                pct_start=0.05)

    ckpt = os.path.join(args.out, "last.pt")
    start_epoch, best, bad = 0, 0.0, 0
    if os.path.exists(ckpt):
        st = torch.load(ckpt, map_location=device)
        model.module.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        start_epoch, best, bad = st["epoch"] + 1, st["best"], st["bad"]
        log.info("resumed at epoch %d best %.4f bad %d", start_epoch, best, bad)

    prof = None
    if args.profile and rank == 0:
        prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                       schedule=schedule(wait=20, warmup=5, active=10, repeat=1),
                       on_trace_ready=tensorboard_trace_handler(os.path.join(args.out, "profile")),
                       record_shapes=False, with_stack=False)
        prof.start()

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (x, y, empty) in enumerate(train_dl):
            x = x.to(device, non_blocking=True)
            y, empty = y.to(device, non_blocking=True), empty.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                ls, le = model(x)
                loss = F.cross_entropy(ls, y, label_smoothing=0.1) + \
                    args.empty_weight * F.binary_cross_entropy_with_logits(le.float(), empty)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if prof is not None:
                prof.step()
            if i % 100 == 0:
                log.info("epoch %d it %d/%d loss %.4f %.2fs/it", epoch, i, len(train_dl), loss.item(),
                         (time.time() - t0) / (i + 1))
        if prof is not None:
            prof.stop()
            prof = None

        bal_acc, per_class = balanced_accuracy(model, val_dl, device)
        if bal_acc > best:
            best, bad = bal_acc, 0
            if rank == 0:
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
        else:
            bad += 1
        if rank == 0:
            worst = sorted(per_class.items(), key=lambda kv: kv[1])[:5]
            log.info("epoch %d balanced_acc %.4f best %.4f bad %d worst %s", epoch, bal_acc, best, bad, worst)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "best": best, "bad": bad}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
        dist.barrier()
        if bad >= args.patience:
            log.info("early stopping at epoch %d", epoch)
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
