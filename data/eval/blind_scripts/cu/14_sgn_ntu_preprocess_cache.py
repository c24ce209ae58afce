"""SGN (semantics-guided network) on NTU-60 / NTU-120.

Preprocessing follows the SGN repo's seq_transformation: keep the most active
body, translate to the spine joint of the first frame, drop empty frames, and
pad/crop; the result is cached next to the raw arrays as <split>_sgn.npy.
"""
import argparse
import os
import os.path as osp
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def seq_transformation(raw, max_frames=300):
    """raw: (N, 3, T, 25, 2) -> (N, max_frames, 75), single main body, translated."""
    n = raw.shape[0]
    out = np.zeros((n, max_frames, 75), dtype=np.float32)
    for i in range(n):
        x = raw[i]                                           # 3, T, 25, 2
        motion = [np.var(x[:, :, :, m], axis=1).sum() for m in range(x.shape[-1])]
        body = x[:, :, :, int(np.argmax(motion))]            # 3, T, 25
        valid = np.abs(body).sum(axis=(0, 2)) > 0
        body = body[:, valid]
        if body.shape[1] == 0:
            continue
        body = body - body[:, :1, 1:2]                       # first-frame spine origin
        seq = body.transpose(1, 2, 0).reshape(body.shape[1], 75)[:max_frames]
        out[i, :len(seq)] = seq
    return out


def load_or_build(root, split):
    cache = osp.join(root, f"{split}_sgn.npy")
    if not osp.isfile(cache):
        raw = np.load(osp.join(root, f"{split}_data_joint.npy"), mmap_mode="r")
        t0 = time.time()
        data = seq_transformation(raw)
        np.save(cache, data)
        print(f"cached {cache} ({len(data)} seqs, {time.time() - t0:.0f}s)", flush=True)
    return np.load(cache, mmap_mode="r"), np.load(osp.join(root, f"{split}_label.npy"))


class SGNFeeder(Dataset):
    def __init__(self, data, labels, seg=20, train=True):
        self.data, self.labels, self.seg, self.train = data, labels, seg, train

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        seq = np.asarray(self.data[i])
        t = max(int((np.abs(seq).sum(1) > 0).sum()), 1)
        seq = seq[:t]
        if self.train:
            bounds = np.linspace(0, t, self.seg + 1)
            idx = (bounds[:-1] + np.random.rand(self.seg) * np.diff(bounds)).astype(np.int64)
            theta = np.random.uniform(-0.5, 0.5, 3) * 0.3
            cx, cy, cz = np.cos(theta)
            sx, sy, sz = np.sin(theta)
            rot = (np.array([[1, 0, 0], [0, cx, sx], [0, -sx, cx]])
                   @ np.array([[cy, 0, -sy], [0, 1, 0], [sy, 0, cy]])
                   @ np.array([[cz, sz, 0], [-sz, cz, 0], [0, 0, 1]])).astype(np.float32)
            seq = (seq.reshape(-1, 25, 3) @ rot.T).reshape(-1, 75)
        else:
            idx = np.linspace(0, t - 1, self.seg).round().astype(np.int64)
        seq = seq[np.minimum(idx, t - 1)]
        return torch.from_numpy(seq.astype(np.float32)), int(self.labels[i])


class Embed(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(cin, 64, 1), nn.ReLU(True), nn.Conv2d(64, cout, 1), nn.ReLU(True))

    def forward(self, x):
        return self.net(x)


class GCNLayer(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.w = nn.Conv2d(cin, cout, 1, bias=False)
        self.w1 = nn.Conv2d(cin, cout, 1)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x, g):
        # x: N, C, V, T ; g: N, T, V, V
        y = torch.einsum("ntuv,ncvt->ncut", g, x)
        return F.relu(self.bn(self.w(y) + self.w1(x)))


class SGN(nn.Module):
    def __init__(self, num_class, seg=20, num_joint=25, dim=256):
        super().__init__()
        self.seg, self.num_joint = seg, num_joint
        self.register_buffer("spa_onehot", torch.eye(num_joint).view(1, num_joint, num_joint, 1))
        self.register_buffer("tem_onehot", torch.eye(seg).view(1, seg, 1, seg))
        self.joint_embed = Embed(3, dim // 4)
        self.dif_embed = Embed(3, dim // 4)
        self.spa_embed = Embed(num_joint, dim // 4)
        self.tem_embed = Embed(seg, dim)
        self.g1 = nn.Conv2d(dim // 2, dim, 1)
        self.g2 = nn.Conv2d(dim // 2, dim, 1)
        self.gcn1 = GCNLayer(dim // 2, dim // 2)
        self.gcn2 = GCNLayer(dim // 2, dim)
        self.gcn3 = GCNLayer(dim, dim)
        self.cnn = nn.Sequential(nn.Conv2d(dim, dim, (1, 3), padding=(0, 1)), nn.BatchNorm2d(dim), nn.ReLU(True),
                                 nn.Dropout2d(0.2), nn.Conv2d(dim, 2 * dim, 1), nn.BatchNorm2d(2 * dim), nn.ReLU(True))
        self.fc = nn.Linear(2 * dim, num_class)

    def forward(self, x):
        n = x.shape[0]
        x = x.view(n, self.seg, self.num_joint, 3).permute(0, 3, 2, 1).contiguous()     # N, 3, V, T
        dif = torch.cat([x.new_zeros(n, 3, self.num_joint, 1), x[..., 1:] - x[..., :-1]], -1)
        pos = self.joint_embed(x) + self.dif_embed(dif)
        spa = self.spa_embed(self.spa_onehot.expand(n, -1, -1, self.seg))
        tem = self.tem_embed(self.tem_onehot.expand(n, -1, self.num_joint, -1))
        h = torch.cat([pos, spa], 1)                                                 # N, dim/2, V, T
        g = torch.einsum("ncut,ncvt->ntuv", self.g1(h), self.g2(h)).softmax(-1)
        h = self.gcn3(self.gcn2(self.gcn1(h, g), g), g) + tem
        h = F.adaptive_max_pool2d(h, (1, self.seg))
        h = self.cnn(h)
        return self.fc(F.adaptive_max_pool2d(h, 1).flatten(1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="data/ntu60/xview")
    ap.add_argument("--num-class", type=int, default=60)
    ap.add_argument("--save", default="results/sgn_ntu60_xview")
    ap.add_argument("--epochs", type=int, default=120)
    ap.add_argument("--batch-size", type=int, default=64, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seg", type=int, default=20)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_x, train_y = load_or_build(args.root, "train")
    test_x, test_y = load_or_build(args.root, "val")
    train_ds = SGNFeeder(train_x, train_y, args.seg, train=True)
    test_ds = SGNFeeder(test_x, test_y, args.seg, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                          pin_memory=True, drop_last=True)
    test_dl = DataLoader(test_ds, batch_size=256, num_workers=8, pin_memory=True)

    model = SGN(args.num_class, seg=args.seg).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * world, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[60, 90, 110], gamma=0.1)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    if rank == 0:
        os.makedirs(args.save, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        stat = torch.zeros(2, device=device)
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            stat += torch.stack([loss.detach() * len(y), torch.tensor(float(len(y)), device=device)])
        scheduler.step()
        dist.all_reduce(stat)

        if rank == 0:
            net = model.module.eval()
            hits = torch.zeros(3, device=device)
            with torch.no_grad():
                for x, y in test_dl:
                    x, y = x.to(device), y.to(device)
                    p5 = net(x).topk(5, 1).indices
                    hits += torch.stack([(p5[:, 0] == y).sum(), (p5 == y[:, None]).any(1).sum(),
                                         torch.tensor(len(y), device=device)]).float()
            top1, top5 = (hits[0] / hits[2]).item(), (hits[1] / hits[2]).item()
            print(f"epoch {epoch + 1} loss {(stat[0] / stat[1]).item():.4f} top1 {top1:.4f} top5 {top5:.4f} "
                  f"{time.time() - t0:.0f}s", flush=True)
            ck = {"epoch": epoch + 1, "state_dict": net.state_dict(), "optimizer": optimizer.state_dict()}
            torch.save(ck, osp.join(args.save, "checkpoint.pth"))
            if top1 > best:
                best = top1
                torch.save(ck, osp.join(args.save, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
