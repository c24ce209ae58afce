"""
WORD abdominal organ segmentation (16 classes), multi-node DDP.

The dataset is staged from GPFS to the node-local NVMe once per node for fast random reads.
After training the best checkpoint is evaluated on the test split by all ranks.

On each of the 2 nodes:
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE:29400 \
        --rdzv_id=word_swin 20_word_multinode_scratch.py --data /gpfs/datasets/WORD --results /gpfs/exp/word
"""
import argparse
import datetime
import json
import os
import shutil
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from monai.data import CacheDataset, DataLoader, Dataset, DistributedSampler, decollate_batch, load_decathlon_datalist
from monai.inferers import sliding_window_inference
from monai.losses import DiceCELoss
from monai.metrics import DiceMetric
from monai.networks.nets import SegResNet
from monai.transforms import (AsDiscrete, Compose, EnsureChannelFirstd, EnsureTyped, LoadImaged, Orientationd,
                              RandCropByLabelClassesd, RandFlipd, RandRotate90d, RandScaleIntensityd,
                              ScaleIntensityRanged, Spacingd, SpatialPadd)

N_CLASSES = 17
ROI = (160, 160, 96)


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/gpfs/datasets/WORD")
    ap.add_argument("--scratch", default=os.environ.get("LOCAL_SCRATCH", "/local_nvme"))
    ap.add_argument("--results", default="/gpfs/exp/word")
    ap.add_argument("--exp", default="word_segresnet")
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--val_every", type=int, default=10)
    return ap.parse_args()


def stage_dataset(src, dst):
    if os.path.exists(os.path.join(dst, ".complete")):
        return
    if os.path.exists(dst):
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    open(os.path.join(dst, ".complete"), "w").close()


def get_transforms():
    keys = ["image", "label"]
    pre = [LoadImaged(keys=keys), EnsureChannelFirstd(keys=keys), Orientationd(keys=keys, axcodes="RAS"),
           Spacingd(keys=keys, pixdim=(1.5, 1.5, 3.0), mode=("bilinear", "nearest")),
           ScaleIntensityRanged(keys="image", a_min=-200, a_max=300, b_min=0, b_max=1, clip=True),
           EnsureTyped(keys=keys, track_meta=False)]
    train = Compose(pre + [
        SpatialPadd(keys=keys, spatial_size=ROI),
        RandCropByLabelClassesd(keys=keys, label_key="label", spatial_size=ROI, num_classes=N_CLASSES, num_samples=2),
        RandFlipd(keys=keys, prob=0.3, spatial_axis=0),
        RandRotate90d(keys=keys, prob=0.2, max_k=3, spatial_axes=(0, 1)),
        RandScaleIntensityd(keys="image", factors=0.1, prob=0.3),
    ])
    return train, Compose(pre)


@torch.no_grad()
def evaluate(net, loader, device, metric, post_pred, post_lbl):
    net.eval()
    for batch in loader:
        x, y = batch["image"].to(device), batch["label"].to(device)
        with torch.cuda.amp.autocast():
            out = sliding_window_inference(x, ROI, 4, net, overlap=0.5)
        metric(y_pred=[post_pred(o) for o in decollate_batch(out)], y=[post_lbl(t) for t in decollate_batch(y)])
    per_class = metric.aggregate()
    metric.reset()
    return per_class


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=1))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    work_dir = os.path.join(args.scratch, args.exp)
    local_data = os.path.join(args.scratch, "WORD")
    if local_rank == 0:
        t0 = time.time()
        stage_dataset(args.data, local_data)
        os.makedirs(work_dir, exist_ok=True)
        print(f"[rank {rank}] staged data to {local_data} in {time.time() - t0:.0f}s", flush=True)
    dist.barrier()

    dl = os.path.join(local_data, "dataset.json")
    train_files = load_decathlon_datalist(dl, True, "training", base_dir=local_data)
    val_files = load_decathlon_datalist(dl, True, "validation", base_dir=local_data)
    test_files = load_decathlon_datalist(dl, True, "test", base_dir=local_data)
    train_tf, val_tf = get_transforms()
    train_ds = CacheDataset(train_files, train_tf, cache_rate=0.5, num_workers=8, progress=False)
    val_ds = Dataset(val_files, val_tf)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=8, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=1, num_workers=4,
                            sampler=DistributedSampler(val_ds, shuffle=False, even_divisible=False))

    net = SegResNet(spatial_dims=3, in_channels=1, out_channels=N_CLASSES, init_filters=32,
                    blocks_down=(1, 2, 2, 4), blocks_up=(1, 1, 1), norm="instance").to(device)
    model = DDP(net, device_ids=[local_rank])
    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    scaler = torch.cuda.amp.GradScaler()
    metric = DiceMetric(include_background=False, reduction="mean_batch")
    post_pred, post_lbl = AsDiscrete(argmax=True, to_onehot=N_CLASSES), AsDiscrete(to_onehot=N_CLASSES)

    best, best_epoch = -1.0, -1
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0, acc = time.time(), torch.zeros(2, device=device)
        for batch in train_loader:
            x, y = batch["image"].to(device, non_blocking=True), batch["label"].to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            with torch.cuda.amp.autocast():
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch} loss {(acc[0] / acc[1]).item():.4f} {time.time() - t0:.0f}s", flush=True)

        if (epoch + 1) % args.val_every == 0:
            dice = evaluate(net, val_loader, device, metric, post_pred, post_lbl).nanmean().item()
            if rank == 0:
                print(f"  val mean dice {dice:.4f}", flush=True)
                torch.save({"epoch": epoch, "model": net.state_dict(), "opt": opt.state_dict(),
                            "sched": sched.state_dict()}, os.path.join(work_dir, "last.pt"))
                if dice > best:
                    torch.save(net.state_dict(), os.path.join(work_dir, "best.pt"))
            if dice > best:
                best, best_epoch = dice, epoch
    dist.barrier()

    # final evaluation of the best weights on the test split, sharded over all ranks
    net.load_state_dict(torch.load(os.path.join(work_dir, "best.pt"), map_location=device))
    test_ds = Dataset(test_files, val_tf)
    test_loader = DataLoader(test_ds, batch_size=1, num_workers=4,
                             sampler=DistributedSampler(test_ds, shuffle=False, even_divisible=False))
    test_dice = evaluate(net, test_loader, device, metric, post_pred, post_lbl)
    if rank == 0:
        os.makedirs(os.path.join(args.results, args.exp), exist_ok=True)
        res = {"best_val_dice": best, "best_epoch": best_epoch, "test_dice_per_organ": test_dice.tolist(),
               "test_mean_dice": test_dice.nanmean().item()}
        with open(os.path.join(args.results, args.exp, "results.json"), "w") as f:
            json.dump(res, f, indent=2)
        print(json.dumps(res, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
