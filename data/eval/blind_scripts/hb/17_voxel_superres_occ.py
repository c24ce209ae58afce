"""Voxel super-resolution with an occupancy network: 32^3 input grid -> continuous occupancy.

    torchrun --nproc_per_node=4 17_voxel_superres_occ.py configs/voxels_onet.yaml
"""
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


class VoxelOccDataset(Dataset):
    def __init__(self, root, split, n_query=2048, query_file="points.npz"):
        self.root = root
        self.models = []
        for cat in sorted(os.listdir(root)):
            lst = os.path.join(root, cat, f"{split}.lst")
            if os.path.isfile(lst):
                with open(lst) as f:
                    self.models += [os.path.join(cat, m.strip()) for m in f if m.strip()]
        self.n_query, self.query_file = n_query, query_file

    def __len__(self):
        return len(self.models)

    def __getitem__(self, i):
        d = os.path.join(self.root, self.models[i])
        vox = np.unpackbits(np.load(os.path.join(d, "model_32.npz"))["voxels"])[: 32 ** 3]
        vox = vox.reshape(32, 32, 32).astype(np.float32)
        pts = np.load(os.path.join(d, self.query_file))
        p = pts["points"].astype(np.float32)
        occ = np.unpackbits(pts["occupancies"])[: len(p)].astype(np.float32)
        if self.n_query > 0:
            j = np.random.randint(len(p), size=self.n_query)
            p, occ = p[j], occ[j]
        return torch.from_numpy(vox), torch.from_numpy(p), torch.from_numpy(occ)


class VoxelEncoder(nn.Module):
    def __init__(self, c_dim=256):
        super().__init__()
        self.conv_in = nn.Conv3d(1, 32, 3, padding=1)
        self.conv_0 = nn.Conv3d(32, 64, 3, padding=1, stride=2)
        self.conv_1 = nn.Conv3d(64, 128, 3, padding=1, stride=2)
        self.conv_2 = nn.Conv3d(128, 256, 3, padding=1, stride=2)
        self.conv_3 = nn.Conv3d(256, 512, 3, padding=1, stride=2)
        self.fc = nn.Linear(512 * 2 * 2 * 2, c_dim)

    def forward(self, x):
        net = self.conv_in(x.unsqueeze(1))
        for conv in (self.conv_0, self.conv_1, self.conv_2, self.conv_3):
            net = conv(F.relu(net))
        return self.fc(F.relu(net).flatten(1))


class CBatchNorm1d(nn.Module):
    """Conditional normalisation (ONet 'CBN'); GroupNorm base so it does not depend on batch size."""

    def __init__(self, c_dim, f_dim):
        super().__init__()
        self.norm = nn.GroupNorm(8, f_dim, affine=False)
        self.gamma = nn.Conv1d(c_dim, f_dim, 1)
        self.beta = nn.Conv1d(c_dim, f_dim, 1)
        nn.init.zeros_(self.gamma.weight)
        nn.init.ones_(self.gamma.bias)
        nn.init.zeros_(self.beta.weight)
        nn.init.zeros_(self.beta.bias)

    def forward(self, x, c):
        c = c.unsqueeze(2)
        return self.gamma(c) * self.norm(x) + self.beta(c)


class CResBlock(nn.Module):
    def __init__(self, c_dim, size):
        super().__init__()
        self.bn_0, self.bn_1 = CBatchNorm1d(c_dim, size), CBatchNorm1d(c_dim, size)
        self.fc_0, self.fc_1 = nn.Conv1d(size, size, 1), nn.Conv1d(size, size, 1)
        nn.init.zeros_(self.fc_1.weight)

    def forward(self, x, c):
        net = self.fc_0(F.relu(self.bn_0(x, c)))
        return x + self.fc_1(F.relu(self.bn_1(net, c)))


class DecoderCBN(nn.Module):
    def __init__(self, c_dim=256, hidden=256, n_blocks=5):
        super().__init__()
        self.fc_p = nn.Conv1d(3, hidden, 1)
        self.blocks = nn.ModuleList([CResBlock(c_dim, hidden) for _ in range(n_blocks)])
        self.bn = CBatchNorm1d(c_dim, hidden)
        self.fc_out = nn.Conv1d(hidden, 1, 1)

    def forward(self, p, c):
        net = self.fc_p(p.transpose(1, 2))
        for blk in self.blocks:
            net = blk(net, c)
        return self.fc_out(F.relu(self.bn(net, c))).squeeze(1)


class VoxelONet(nn.Module):
    def __init__(self, c_dim=256):
        super().__init__()
        self.encoder = VoxelEncoder(c_dim)
        self.decoder = DecoderCBN(c_dim)

    def forward(self, p, vox):
        return self.decoder(p, self.encoder(vox))


@torch.no_grad()
def evaluate_iou(model, loader, device, chunk=50000):
    model.eval()
    iou_sum, n = 0.0, 0
    for vox, p, occ in loader:
        vox, p, occ = vox.to(device), p.to(device), occ.to(device)
        c = model.encoder(vox)
        logits = torch.cat([model.decoder(pc, c) for pc in p.split(chunk, dim=1)], 1)
        pred, gt = logits > 0, occ > 0.5
        iou = (pred & gt).sum(1).float() / (pred | gt).sum(1).float().clamp(min=1)
        iou_sum += iou.sum().item()
        n += iou.numel()
    model.train()
    return iou_sum, n


def main():
    with open(sys.argv[1]) as f:
        cfg = yaml.safe_load(f)
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg["seed"] + rank)
    np.random.seed(cfg["seed"] + rank)

    train_set = VoxelOccDataset(cfg["data_root"], "train", cfg["n_query"])
    val_set = VoxelOccDataset(cfg["data_root"], "val", n_query=0, query_file="points_iou.npz")
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=cfg["batch_size"], sampler=sampler,
                              num_workers=cfg["workers"], pin_memory=True, drop_last=True)
    # each rank evaluates every world-th val model, nothing is duplicated
    val_shard = Subset(val_set, list(range(rank, len(val_set), world)))
    val_loader = DataLoader(val_shard, batch_size=1, num_workers=2)

    model = DDP(VoxelONet(cfg["c_dim"]).to(device), device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    writer = SummaryWriter(cfg["out_dir"]) if rank == 0 else None

    it, best_iou = 0, -1.0
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for vox, p, occ in train_loader:
            vox, p, occ = vox.to(device, non_blocking=True), p.to(device, non_blocking=True), occ.to(device, non_blocking=True)
            logits = model(p, vox)
            loss = F.binary_cross_entropy_with_logits(logits, occ, reduction="none").sum(-1).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            it += 1
            if writer is not None and it % cfg["print_every"] == 0:
                writer.add_scalar("train/loss", loss.item(), it)
                print(f"[epoch {epoch} it {it}] loss={loss.item():.4f} {time.time() - t0:.1f}s", flush=True)

        if (epoch + 1) % cfg["validate_every"] == 0:
            iou_sum, n = evaluate_iou(model.module, val_loader, device)
            totals = torch.tensor([iou_sum, n], dtype=torch.float64)
            dist.all_reduce(totals)
            val_iou = (totals[0] / totals[1]).item()
            if rank == 0:
                writer.add_scalar("val/iou", val_iou, it)
                print(f"epoch {epoch}: val IoU {val_iou:.4f}", flush=True)
                state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                         "epoch": epoch, "it": it, "val_iou": val_iou}
                torch.save(state, os.path.join(cfg["out_dir"], "model.pt"))
                if val_iou > best_iou:
                    best_iou = val_iou
                    torch.save(state, os.path.join(cfg["out_dir"], "model_best.pt"))
            dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
