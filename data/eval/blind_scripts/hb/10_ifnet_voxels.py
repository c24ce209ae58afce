"""IF-Net (implicit feature networks) for voxel super-resolution / point cloud completion.

Launch:  torchrun --nproc_per_node=4 10_ifnet_voxels.py --data_dir shapenet/data --res 128 --pc_samples 3000
"""
import argparse
import glob
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


class VoxelizedDataset(Dataset):
    def __init__(self, data_dir, split_file, split, res, pc_samples, num_sample_points=50000,
                 sample_distribution=(0.5, 0.5), sample_sigmas=(0.1, 0.01)):
        split_ids = np.load(split_file)[split]
        self.paths = [os.path.join(data_dir, p) for p in split_ids]
        self.res, self.pc_samples = res, pc_samples
        self.num_samples = [int(num_sample_points * d) for d in sample_distribution]
        self.sigmas = sample_sigmas

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, idx):
        path = self.paths[idx]
        occ = np.unpackbits(np.load(f"{path}/voxelized_point_cloud_{self.res}res_{self.pc_samples}points.npz")
                            ["compressed_occupancies"])
        inputs = np.reshape(occ, (self.res,) * 3).astype(np.float32)
        points, occupancies = [], []
        for n, sigma in zip(self.num_samples, self.sigmas):
            f = glob.glob(f"{path}/boundary_{sigma}_samples.npz")[0]
            b = np.load(f)
            sel = np.random.randint(0, len(b["points"]), n)
            points.append(b["grid_coords"][sel])
            occupancies.append(b["occupancies"][sel])
        return {"inputs": torch.from_numpy(inputs),
                "grid_coords": torch.from_numpy(np.concatenate(points).astype(np.float32)),
                "occupancies": torch.from_numpy(np.concatenate(occupancies).astype(np.float32))}


def conv_bn(cin, cout):
    return nn.Sequential(nn.Conv3d(cin, cout, 3, padding=1, padding_mode="replicate"),
                         nn.BatchNorm3d(cout), nn.ReLU(inplace=True))


class IFNet(nn.Module):
    def __init__(self, hidden_dim=256):
        super().__init__()
        chans = [1, 16, 32, 64, 128, 128]
        self.stages = nn.ModuleList([nn.Sequential(conv_bn(cin, cout), conv_bn(cout, cout))
                                     for cin, cout in zip(chans[:-1], chans[1:])])
        self.maxpool = nn.MaxPool3d(2)
        feat_dim = (sum(chans) + 0) * 7
        self.fc_0 = nn.Conv1d(feat_dim, hidden_dim * 2, 1)
        self.fc_1 = nn.Conv1d(hidden_dim * 2, hidden_dim, 1)
        self.fc_2 = nn.Conv1d(hidden_dim, hidden_dim, 1)
        self.fc_out = nn.Conv1d(hidden_dim, 1, 1)
        d = 0.0722
        disp = [[0, 0, 0]] + [[s * d if i == j else 0 for j in range(3)] for i in range(3) for s in (-1, 1)]
        self.register_buffer("displacements", torch.tensor(disp, dtype=torch.float32))

    def forward(self, p, x):
        x = x.unsqueeze(1)
        p = p.unsqueeze(1).unsqueeze(1)
        p = torch.cat([p + d for d in self.displacements], dim=2)  # B,1,7,N,3
        feats = [F.grid_sample(x, p, padding_mode="border", align_corners=False)]
        net = x
        for k, stage in enumerate(self.stages):
            net = stage(net)
            feats.append(F.grid_sample(net, p, padding_mode="border", align_corners=False))
            if k < len(self.stages) - 1:
                net = self.maxpool(net)
        features = torch.cat(feats, dim=1)
        B, C, _, D, N = features.shape
        features = features.reshape(B, C * D, N)
        net = F.relu(self.fc_0(features))
        net = F.relu(self.fc_1(net))
        net = F.relu(self.fc_2(net))
        return self.fc_out(net).squeeze(1)


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data_dir", default="shapenet/data")
    parser.add_argument("--split_file", default="shapenet/split.npz")
    parser.add_argument("--res", type=int, default=128)
    parser.add_argument("--pc_samples", type=int, default=3000)
    parser.add_argument("--batch_size", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--epochs", type=int, default=1500)
    parser.add_argument("--exp_name", default="ifnet_pc3000")
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


def compute_loss(model, batch, device):
    p = batch["grid_coords"].to(device, non_blocking=True)
    occ = batch["occupancies"].to(device, non_blocking=True)
    inputs = batch["inputs"].to(device, non_blocking=True)
    logits = model(p, inputs)
    return F.binary_cross_entropy_with_logits(logits, occ, reduction="none").sum(-1).mean()


def main():
    args = get_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    random.seed(rank)
    np.random.seed(rank)

    exp_path = os.path.join("experiments", args.exp_name)
    ckpt_path = os.path.join(exp_path, "checkpoints")
    train_ds = VoxelizedDataset(args.data_dir, args.split_file, "train", args.res, args.pc_samples)
    val_ds = VoxelizedDataset(args.data_dir, args.split_file, "val", args.res, args.pc_samples)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                          pin_memory=True, drop_last=True,
                          worker_init_fn=lambda w: np.random.seed(np.random.get_state()[1][0] + w))

    model = IFNet()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    start_epoch = 0
    if os.path.isdir(ckpt_path) and os.listdir(ckpt_path):
        last = max(glob.glob(os.path.join(ckpt_path, "*.tar")), key=os.path.getmtime)
        ck = torch.load(last, map_location=device)
        model.module.load_state_dict(ck["model_state_dict"])
        optimizer.load_state_dict(ck["optimizer_state_dict"])
        start_epoch = ck["epoch"] + 1

    writer = None
    if rank == 0:
        os.makedirs(ckpt_path, exist_ok=True)
        writer = SummaryWriter(os.path.join(exp_path, "summary"))
        val_dl = DataLoader(val_ds, batch_size=args.batch_size, shuffle=True, num_workers=4)
    best_val = float("inf")

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        sum_loss = torch.zeros(1, device=device)
        for batch in train_dl:
            loss = compute_loss(model, batch, device)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            sum_loss += loss.detach()
        dist.all_reduce(sum_loss)
        train_loss = sum_loss.item() / (len(train_dl) * world)

        if rank == 0:
            torch.save({"epoch": epoch, "model_state_dict": model.module.state_dict(),
                        "optimizer_state_dict": optimizer.state_dict()},
                       os.path.join(ckpt_path, f"checkpoint_epoch_{epoch}.tar"))
            model.eval()
            with torch.no_grad():
                it = iter(val_dl)
                val_loss = np.mean([compute_loss(model.module, next(it), device).item() for _ in range(20)])
            model.train()
            writer.add_scalar("training loss last batch", train_loss, epoch)
            writer.add_scalar("val loss batch avg", val_loss, epoch)
            if val_loss < best_val:
                best_val = val_loss
                np.save(os.path.join(exp_path, "val_min.npy"), [epoch, val_loss])
            print(f"epoch {epoch}: train {train_loss:.3f}  val {val_loss:.3f}", flush=True)
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
