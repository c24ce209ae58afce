#!/usr/bin/env python
"""
Atlas-based VoxelMorph training (voxelmorph pytorch backend) wrapped in DDP.

    torchrun --nproc_per_node=4 08_vxm_atlas_ddp_pkg.py \
        --img-list lists/train.txt --val-list lists/val.txt --atlas data/atlas_norm.npz \
        --model-dir models/vxm_atlas --int-steps 7 --int-downsize 2
"""
import os
os.environ.setdefault("VXM_BACKEND", "pytorch")

import argparse
import time

import numpy as np
import torch
import torch.distributed as dist
import voxelmorph as vxm
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

parser = argparse.ArgumentParser()
parser.add_argument("--img-list", required=True)
parser.add_argument("--val-list", required=True)
parser.add_argument("--img-prefix", default="")
parser.add_argument("--img-suffix", default="")
parser.add_argument("--atlas", required=True)
parser.add_argument("--model-dir", default="models")
parser.add_argument("--epochs", type=int, default=1500)
parser.add_argument("--steps-per-epoch", type=int, default=100)
parser.add_argument("--batch-size", type=int, default=1)
parser.add_argument("--lr", type=float, default=1e-4)
parser.add_argument("--enc", type=int, nargs="+", default=[16, 32, 32, 32])
parser.add_argument("--dec", type=int, nargs="+", default=[32, 32, 32, 32, 32, 16, 16])
parser.add_argument("--int-steps", type=int, default=7)
parser.add_argument("--int-downsize", type=int, default=2)
parser.add_argument("--image-loss", default="ncc", choices=["ncc", "mse"])
parser.add_argument("--lambda", dest="weight", type=float, default=0.01)
parser.add_argument("--val-every", type=int, default=20)
args = parser.parse_args()


class ScanDataset(Dataset):
    def __init__(self, files, with_seg=False):
        self.files = files
        self.with_seg = with_seg

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        if self.with_seg:
            npz = np.load(self.files[i])
            vol, seg = npz["vol"], npz["seg"]
            return torch.from_numpy(vol[None].astype(np.float32)), torch.from_numpy(seg[None].astype(np.int64))
        vol = vxm.py.utils.load_volfile(self.files[i], np_var="vol")
        return torch.from_numpy(vol[None].astype(np.float32))


def read_list(fname):
    return [args.img_prefix + l.strip() + args.img_suffix for l in open(fname) if l.strip()]


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_files = read_list(args.img_list)
    val_files = read_list(args.val_list)
    atlas = np.load(args.atlas)
    atlas_vol = torch.from_numpy(atlas["vol"][None, None].astype(np.float32)).to(device)
    atlas_seg = torch.from_numpy(atlas["seg"][None, None].astype(np.float32)).to(device)
    inshape = atlas["vol"].shape
    labels = np.unique(atlas["seg"])[1:]

    train_ds = ScanDataset(train_files)
    val_ds = ScanDataset(val_files, with_seg=True)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=1, sampler=val_sampler, num_workers=2)

    model = vxm.networks.VxmDense(inshape=inshape, nb_unet_features=[args.enc, args.dec],
                                  int_steps=args.int_steps, int_downsize=args.int_downsize)
    model.to(device)
    model = DDP(model, device_ids=[local_rank])
    warp_nn = vxm.layers.SpatialTransformer(inshape, mode="nearest").to(device)

    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    image_loss = vxm.losses.NCC().loss if args.image_loss == "ncc" else vxm.losses.MSE().loss
    grad_loss = vxm.losses.Grad("l2", loss_mult=args.int_downsize).loss

    if rank == 0:
        os.makedirs(args.model_dir, exist_ok=True)
    best_dice = 0.0

    data_iter, epoch_of_iter = None, 0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        losses = []
        for step in range(args.steps_per_epoch):
            if data_iter is None:
                train_sampler.set_epoch(epoch_of_iter)
                data_iter = iter(train_loader)
            try:
                moving = next(data_iter)
            except StopIteration:
                epoch_of_iter += 1
                train_sampler.set_epoch(epoch_of_iter)
                data_iter = iter(train_loader)
                moving = next(data_iter)
            moving = moving.to(device, non_blocking=True)
            fixed = atlas_vol.expand(moving.shape[0], -1, -1, -1, -1)

            y_pred, preint_flow = model(moving, fixed)
            loss_sim = image_loss(fixed, y_pred)
            loss_reg = grad_loss(None, preint_flow)
            loss = loss_sim + args.weight * loss_reg

            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append([loss.item(), loss_sim.item(), loss_reg.item()])

        if rank == 0:
            l = np.mean(losses, 0)
            print(f"Epoch {epoch + 1}/{args.epochs} - {time.time() - t0:.1f}s - loss {l[0]:.4e} "
                  f"(sim {l[1]:.4e}, reg {l[2]:.4e})", flush=True)

        if (epoch + 1) % args.val_every == 0:
            net = model.module
            net.eval()
            dices = []
            with torch.no_grad():
                for vol, seg in val_loader:
                    vol, seg = vol.to(device), seg.to(device).float()
                    # same direction as training (scan -> atlas); compare with the atlas labels
                    _, flow = net(vol, atlas_vol, registration=True)
                    warped_seg = warp_nn(seg, flow)
                    overlap = vxm.py.utils.dice(warped_seg[0, 0].long().cpu().numpy(),
                                                atlas_seg[0, 0].long().cpu().numpy(), labels=labels)
                    dices.append(np.mean(overlap))
            val_dice = float(np.mean(dices))

            if rank == 0:
                print(f"  val Dice {val_dice:.4f} (best {best_dice:.4f})", flush=True)
                if val_dice > best_dice:
                    best_dice = val_dice
                    net.save(os.path.join(args.model_dir, "best.pt"))
                net.save(os.path.join(args.model_dir, f"{epoch + 1:04d}.pt"))
            dist.barrier()

    if rank == 0:
        model.module.save(os.path.join(args.model_dir, "final.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
