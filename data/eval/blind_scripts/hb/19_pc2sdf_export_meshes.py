"""Point cloud -> SDF network (DGCNN-lite encoder, MLP SDF decoder); exports test meshes with marching cubes.

    torchrun --nproc_per_node=4 19_pc2sdf_export_meshes.py --root data/abc_sdf --out runs/pc2sdf
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import trimesh
from skimage import measure
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class ABCSdf(Dataset):
    def __init__(self, root, split, n_in=4096, n_query=8192):
        with open(os.path.join(root, f"{split}.txt")) as f:
            self.names = [l.strip() for l in f if l.strip()]
        self.root, self.n_in, self.n_query = root, n_in, n_query

    def __len__(self):
        return len(self.names)

    def load_input(self, i):
        pc = np.load(os.path.join(self.root, "scans", self.names[i] + ".npy")).astype(np.float32)
        sel = np.random.choice(len(pc), self.n_in, replace=len(pc) < self.n_in)
        return torch.from_numpy(pc[sel])

    def __getitem__(self, i):
        d = np.load(os.path.join(self.root, "sdf", self.names[i] + ".npz"))
        q, sdf = d["points"], d["sdf"]
        j = np.random.randint(len(q), size=self.n_query)
        return self.load_input(i), torch.from_numpy(q[j].astype(np.float32)), torch.from_numpy(sdf[j].astype(np.float32))


def knn_group(x, k):
    # x: B x N x C -> B x N x k x C neighbours (feature space)
    d = torch.cdist(x, x)
    idx = d.topk(k, largest=False)[1]
    B, N, C = x.shape
    return torch.gather(x.unsqueeze(1).expand(B, N, N, C), 2, idx.unsqueeze(-1).expand(-1, -1, -1, C))


class EdgeBlock(nn.Module):
    def __init__(self, cin, cout, k=16):
        super().__init__()
        self.k = k
        self.mlp = nn.Sequential(nn.Linear(2 * cin, cout), nn.LeakyReLU(0.2), nn.Linear(cout, cout))

    def forward(self, x):
        nb = knn_group(x, self.k)
        ctr = x.unsqueeze(2).expand_as(nb)
        return self.mlp(torch.cat([nb - ctr, ctr], -1)).max(2)[0]


class Encoder(nn.Module):
    def __init__(self, z=512):
        super().__init__()
        self.e1, self.e2, self.e3 = EdgeBlock(3, 64), EdgeBlock(64, 128), EdgeBlock(128, 256)
        self.fc = nn.Linear(64 + 128 + 256, z)

    def forward(self, p):
        # subsample for the kNN graph to keep memory bounded
        p = p[:, torch.randperm(p.shape[1], device=p.device)[:1024]]
        f1 = self.e1(p)
        f2 = self.e2(f1)
        f3 = self.e3(f2)
        return self.fc(torch.cat([f1, f2, f3], -1)).max(1)[0]


class SDFDecoder(nn.Module):
    def __init__(self, z=512, hidden=512):
        super().__init__()
        self.l1 = nn.Linear(z + 3, hidden)
        self.l2 = nn.Linear(hidden, hidden)
        self.l3 = nn.Linear(hidden, hidden - z - 3)
        self.l4 = nn.Linear(hidden, hidden)
        self.l5 = nn.Linear(hidden, 1)

    def forward(self, q, z):
        x = torch.cat([z.unsqueeze(1).expand(-1, q.shape[1], -1), q], -1)
        h = F.softplus(self.l1(x), beta=100)
        h = F.softplus(self.l2(h), beta=100)
        h = F.softplus(self.l3(h), beta=100)
        h = F.softplus(self.l4(torch.cat([h, x], -1)), beta=100)
        return self.l5(h).squeeze(-1)


class PC2SDF(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = Encoder()
        self.decoder = SDFDecoder()

    def forward(self, pc, q):
        return self.decoder(q, self.encoder(pc))


@torch.no_grad()
def extract_mesh(net, pc, device, res=128, chunk=65536, bound=1.05):
    z = net.encoder(pc.unsqueeze(0).to(device))
    lin = torch.linspace(-bound, bound, res, device=device)
    grid = torch.stack(torch.meshgrid(lin, lin, lin, indexing="ij"), -1).view(1, -1, 3)
    sdf = torch.cat([net.decoder(g, z) for g in grid.split(chunk, dim=1)], 1).view(res, res, res).cpu().numpy()
    if sdf.min() > 0 or sdf.max() < 0:
        return None
    verts, faces, _, _ = measure.marching_cubes(sdf, level=0.0, spacing=(2 * bound / (res - 1),) * 3)
    return trimesh.Trimesh(verts - bound, faces)


def export_test_meshes(args, ckpt_path, device):
    net = PC2SDF().to(device).eval()
    state = torch.load(ckpt_path, map_location=device)
    net.load_state_dict(state["model"])
    test_set = ABCSdf(args.root, "test")
    out_dir = os.path.join(args.out, "meshes")
    os.makedirs(out_dir, exist_ok=True)
    for i in range(min(len(test_set), args.n_export)):
        mesh = extract_mesh(net, test_set.load_input(i), device)
        if mesh is not None:
            mesh.export(os.path.join(out_dir, test_set.names[i] + ".ply"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--batch_size", type=int, default=12)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--clamp", type=float, default=0.1)
    ap.add_argument("--n_export", type=int, default=50)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    ckpt_path = os.path.join(args.out, "checkpoint.pth")

    ds = ABCSdf(args.root, "train")
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, args.batch_size, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)

    model = DDP(PC2SDF().to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs)
    start_epoch = 0
    if args.resume and os.path.isfile(ckpt_path):
        state = torch.load(ckpt_path, map_location=device)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start_epoch = state["epoch"] + 1
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for pc, q, sdf in dl:
            pc, q, sdf = pc.to(device, non_blocking=True), q.to(device, non_blocking=True), sdf.to(device, non_blocking=True)
            pred = model(pc, q)
            loss = (pred.clamp(-args.clamp, args.clamp) - sdf.clamp(-args.clamp, args.clamp)).abs().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(running)
        if rank == 0:
            print(f"epoch {epoch}: L1 {(running[0] / running[1]).item():.5f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch}, ckpt_path)
        dist.barrier()

    if rank == 0:
        export_test_meshes(args, ckpt_path, device)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
