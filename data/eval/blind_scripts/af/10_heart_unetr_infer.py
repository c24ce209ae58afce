# Left atrium segmentation (MSD Task02_Heart) with UNETR.
# Trains with DDP, then rank 0 reloads the best weights and writes predictions for the test images.
#
#   torchrun --nproc_per_node=2 10_heart_unetr_infer.py --data-dir /data/Task02_Heart --out-dir exp/heart_unetr
import argparse
import os
import time
from glob import glob

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from monai.data import CacheDataset, DataLoader, Dataset, DistributedSampler, decollate_batch
from monai.inferers import sliding_window_inference
from monai.losses import DiceCELoss
from monai.metrics import DiceMetric
from monai.networks.nets import UNETR
from monai.transforms import (Activationsd, AsDiscrete, AsDiscreted, Compose, CropForegroundd, EnsureChannelFirstd,
                              Invertd, LoadImaged, NormalizeIntensityd, Orientationd, RandCropByPosNegLabeld,
                              RandFlipd, RandRotate90d, RandShiftIntensityd, SaveImaged, Spacingd)

ROI = (96, 96, 96)


def cli():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", default="/data/Task02_Heart")
    ap.add_argument("--out-dir", default="exp/heart_unetr")
    ap.add_argument("--epochs", type=int, default=800)
    ap.add_argument("--val-every", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--workers", type=int, default=4)
    return ap.parse_args()


def build_lists(root):
    imgs = sorted(glob(os.path.join(root, "imagesTr", "la_*.nii.gz")))
    segs = sorted(glob(os.path.join(root, "labelsTr", "la_*.nii.gz")))
    pairs = [{"image": i, "label": s} for i, s in zip(imgs, segs)]
    test = [{"image": i} for i in sorted(glob(os.path.join(root, "imagesTs", "la_*.nii.gz")))]
    return pairs[:16], pairs[16:], test


def main():
    args = cli()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    lr_ = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(lr_)
    device = torch.device("cuda", lr_)
    os.makedirs(args.out_dir, exist_ok=True)

    keys = ["image", "label"]
    pre = [LoadImaged(keys=keys), EnsureChannelFirstd(keys=keys), Orientationd(keys=keys, axcodes="RAS"),
           Spacingd(keys=keys, pixdim=(1.25, 1.25, 1.37), mode=("bilinear", "nearest")),
           NormalizeIntensityd(keys="image", nonzero=True), CropForegroundd(keys=keys, source_key="image")]
    train_tf = Compose(pre + [
        RandCropByPosNegLabeld(keys=keys, label_key="label", spatial_size=ROI, pos=1, neg=1, num_samples=4),
        RandFlipd(keys=keys, prob=0.2, spatial_axis=0),
        RandFlipd(keys=keys, prob=0.2, spatial_axis=1),
        RandRotate90d(keys=keys, prob=0.2, max_k=3),
        RandShiftIntensityd(keys="image", offsets=0.1, prob=0.5),
    ])
    val_tf = Compose(pre)

    train_files, val_files, test_files = build_lists(args.data_dir)
    train_ds = CacheDataset(train_files, train_tf, cache_rate=1.0, num_workers=args.workers)
    val_ds = CacheDataset(val_files, val_tf, cache_rate=1.0, num_workers=args.workers)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, even_divisible=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=1, sampler=val_sampler, num_workers=args.workers)

    model = UNETR(in_channels=1, out_channels=2, img_size=ROI, feature_size=16, hidden_size=768, mlp_dim=3072,
                  num_heads=12, proj_type="perceptron", norm_name="instance", res_block=True,
                  dropout_rate=0.0).to(device)
    model = DDP(model, device_ids=[lr_])
    loss_function = DiceCELoss(to_onehot_y=True, softmax=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5)
    dice_metric = DiceMetric(include_background=False, reduction="mean")
    post_pred = AsDiscrete(argmax=True, to_onehot=2)
    post_label = AsDiscrete(to_onehot=2)

    best_metric, best_epoch = -1.0, -1
    best_path = os.path.join(args.out_dir, "best_metric_model.pth")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0, epoch_loss, steps = time.time(), 0.0, 0
        for batch in train_loader:
            x, y = batch["image"].to(device), batch["label"].to(device)
            optimizer.zero_grad()
            loss = loss_function(model(x), y)
            loss.backward()
            optimizer.step()
            epoch_loss += loss.item()
            steps += 1
        if rank == 0:
            print(f"epoch {epoch + 1}: avg loss {epoch_loss / steps:.4f} ({time.time() - t0:.1f}s)")

        if (epoch + 1) % args.val_every == 0:
            model.eval()
            with torch.no_grad():
                for batch in val_loader:
                    x, y = batch["image"].to(device), batch["label"].to(device)
                    out = sliding_window_inference(x, ROI, 4, model.module)
                    dice_metric(y_pred=[post_pred(i) for i in decollate_batch(out)],
                                y=[post_label(i) for i in decollate_batch(y)])
            metric = dice_metric.aggregate().item()
            dice_metric.reset()
            if metric > best_metric:
                best_metric, best_epoch = metric, epoch + 1
                if rank == 0:
                    torch.save(model.state_dict(), best_path)
            if rank == 0:
                print(f"  mean dice {metric:.4f}, best {best_metric:.4f} at epoch {best_epoch}")
    dist.barrier()

    if rank == 0:
        # predictions for the test images, resampled back to the original space
        test_tf = Compose([LoadImaged(keys="image"), EnsureChannelFirstd(keys="image"),
                           Orientationd(keys="image", axcodes="RAS"),
                           Spacingd(keys="image", pixdim=(1.25, 1.25, 1.37), mode="bilinear"),
                           NormalizeIntensityd(keys="image", nonzero=True),
                           CropForegroundd(keys="image", source_key="image")])
        post_tf = Compose([
            Invertd(keys="pred", transform=test_tf, orig_keys="image", nearest_interp=False, to_tensor=True),
            Activationsd(keys="pred", softmax=True),
            AsDiscreted(keys="pred", argmax=True),
            SaveImaged(keys="pred", output_dir=os.path.join(args.out_dir, "test_pred"), output_postfix="seg",
                       resample=False, separate_folder=False),
        ])
        test_loader = DataLoader(Dataset(test_files, test_tf), batch_size=1, num_workers=args.workers)
        infer_model = UNETR(in_channels=1, out_channels=2, img_size=ROI, feature_size=16, hidden_size=768,
                            mlp_dim=3072, num_heads=12, proj_type="perceptron", norm_name="instance",
                            res_block=True, dropout_rate=0.0).to(device)
        infer_model.load_state_dict(torch.load(best_path, map_location=device))
        infer_model.eval()
        with torch.no_grad():
            for batch in test_loader:
                batch["pred"] = sliding_window_inference(batch["image"].to(device), ROI, 4, infer_model,
                                                         overlap=0.5)
                batch = [post_tf(i) for i in decollate_batch(batch)]
        print(f"wrote {len(test_files)} predictions, best val dice {best_metric:.4f} (epoch {best_epoch})")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
