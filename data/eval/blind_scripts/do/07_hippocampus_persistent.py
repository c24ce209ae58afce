"""Hippocampus head/body segmentation (MSD Task04) - DynUNet with deep supervision.

Data are small (~35^3 voxels) so we cache the preprocessed volumes on the
shared scratch with PersistentDataset.

    torchrun --nnodes=2 --nproc_per_node=4 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29400 \
        07_hippocampus_persistent.py --init_from /shared/pretrained/hippo_ssl.pt
"""
import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import wandb
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from monai.data import DataLoader, Dataset, PersistentDataset, decollate_batch, load_decathlon_datalist
from monai.data import DistributedSampler as EvalSampler
from monai.inferers import sliding_window_inference
from monai.losses import DiceCELoss
from monai.metrics import DiceMetric
from monai.networks.nets import DynUNet
from monai.transforms import (
    AsDiscrete,
    Compose,
    EnsureChannelFirstd,
    EnsureTyped,
    LoadImaged,
    NormalizeIntensityd,
    Orientationd,
    RandAffined,
    RandFlipd,
    RandGaussianNoised,
    RandSpatialCropd,
    SpatialPadd,
)

ROI = (40, 56, 40)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", default="/shared/data/Task04_Hippocampus")
    ap.add_argument("--cache_dir", default="/shared/scratch/cache/hippocampus_v1")
    ap.add_argument("--out_dir", default="/shared/runs/hippocampus")
    ap.add_argument("--init_from", default="")
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--batch_size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--val_every", type=int, default=10)
    ap.add_argument("--project", default="hippocampus-seg")
    return ap.parse_args()


def get_transforms():
    pre = [
        LoadImaged(keys=["image", "label"]),
        EnsureChannelFirstd(keys=["image", "label"]),
        Orientationd(keys=["image", "label"], axcodes="RAS"),
        NormalizeIntensityd(keys="image", nonzero=True),
        SpatialPadd(keys=["image", "label"], spatial_size=ROI),
        EnsureTyped(keys=["image", "label"], track_meta=False),
    ]
    aug = [
        RandSpatialCropd(keys=["image", "label"], roi_size=ROI, random_size=False),
        RandAffined(keys=["image", "label"], prob=0.2, rotate_range=(0.26, 0.26, 0.26),
                    scale_range=(0.15, 0.15, 0.15), mode=("bilinear", "nearest")),
        RandGaussianNoised(keys="image", prob=0.15, std=0.05),
        RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=0),
    ]
    return pre, aug


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=timedelta(minutes=45))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_list = load_decathlon_datalist(os.path.join(args.data_dir, "dataset.json"), True, "training",
                                         base_dir=args.data_dir)
    val_list, train_list = train_list[:52], train_list[52:]
    pre, aug = get_transforms()

    # build the cache once (global rank 0 on the shared FS), everyone else waits
    if rank == 0:
        os.makedirs(args.cache_dir, exist_ok=True)
        os.makedirs(args.out_dir, exist_ok=True)
        warm = PersistentDataset(train_list, transform=Compose(pre), cache_dir=args.cache_dir)
        for i in range(len(warm)):
            _ = warm[i]
    dist.barrier()

    train_ds = PersistentDataset(train_list, transform=Compose(pre + aug), cache_dir=args.cache_dir)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=6, pin_memory=True, persistent_workers=True)
    val_ds = Dataset(val_list, transform=Compose(pre))
    val_loader = DataLoader(val_ds, batch_size=1, sampler=EvalSampler(val_ds, shuffle=False, even_divisible=False),
                            num_workers=2)

    net = DynUNet(spatial_dims=3, in_channels=1, out_channels=3,
                  kernel_size=[3, 3, 3, 3], strides=[1, 2, 2, 2], upsample_kernel_size=[2, 2, 2],
                  norm_name="instance", deep_supervision=True, deep_supr_num=2)
    if args.init_from:
        sd = torch.load(args.init_from, map_location="cpu")
        sd = sd.get("state_dict", sd)
        # the SSL checkpoint was written from a DDP-wrapped model
        consume_prefix_in_state_dict_if_present(sd, "module.")
        missing, unexpected = net.load_state_dict(sd, strict=False)
        if rank == 0:
            print(f"init from {args.init_from}: {len(missing)} missing, {len(unexpected)} unexpected keys")
    net = net.to(device)
    model = DDP(net, device_ids=[local_rank], gradient_as_bucket_view=True)

    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.99, nesterov=True, weight_decay=3e-5)
    sched = torch.optim.lr_scheduler.PolynomialLR(opt, total_iters=args.epochs, power=0.9)
    dice_metric = DiceMetric(include_background=False, reduction="mean_batch")
    post_pred, post_lab = AsDiscrete(argmax=True, to_onehot=3), AsDiscrete(to_onehot=3)

    run = wandb.init(project=args.project, config=vars(args)) if rank == 0 else None
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        loss_sum = torch.zeros((), device=device)
        for step, batch in enumerate(train_loader):
            img = batch["image"].to(device, non_blocking=True)
            lab = batch["label"].to(device, non_blocking=True)
            outs = torch.unbind(model(img), dim=1)  # main output + 2 supervision heads
            weights = [0.5 ** i for i in range(len(outs))]
            loss = sum(w * loss_fn(o, lab) for w, o in zip(weights, outs)) / sum(weights)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_sum += loss.detach()
        sched.step()
        dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
        if run is not None:
            run.log({"train/loss": loss_sum.item() / (step + 1), "lr": sched.get_last_lr()[0]}, step=epoch)

        if (epoch + 1) % args.val_every == 0:
            net.eval()
            with torch.no_grad():
                for batch in val_loader:
                    img, lab = batch["image"].to(device), batch["label"].to(device)
                    logits = sliding_window_inference(img, ROI, 1, net)
                    dice_metric(y_pred=[post_pred(x) for x in decollate_batch(logits)],
                                y=[post_lab(x) for x in decollate_batch(lab)])
            anterior, posterior = dice_metric.aggregate().tolist()
            dice_metric.reset()
            if rank == 0:
                mean = (anterior + posterior) / 2
                run.log({"val/anterior": anterior, "val/posterior": posterior, "val/mean": mean}, step=epoch)
                if mean > best:
                    best = mean
                    torch.save({"epoch": epoch, "state_dict": net.state_dict()},
                               os.path.join(args.out_dir, "best.pt"))
            dist.barrier()

    if rank == 0:
        torch.save({"epoch": args.epochs, "state_dict": net.state_dict(), "optimizer": opt.state_dict()},
                   os.path.join(args.out_dir, "final.pt"))
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
