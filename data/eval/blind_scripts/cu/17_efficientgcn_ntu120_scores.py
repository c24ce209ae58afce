"""EfficientGCN-B0 style multi-input (joint / velocity / bone) network on NTU-120.

After training, the best checkpoint is re-evaluated on the full test set and the
per-sample class scores are written for late fusion with the other runs.
"""
import argparse
import logging
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("efficientgcn")
NTU_BONES = [(1, 2), (2, 21), (3, 21), (4, 3), (5, 21), (6, 5), (7, 6), (8, 7), (9, 21), (10, 9), (11, 10),
             (12, 11), (13, 1), (14, 13), (15, 14), (16, 15), (17, 1), (18, 17), (19, 18), (20, 19),
             (22, 23), (23, 8), (24, 25), (25, 12)]


def make_A():
    A = np.eye(25, dtype=np.float32)
    for a, b in NTU_BONES:
        A[a - 1, b - 1] = A[b - 1, a - 1] = 1
    d = A.sum(1) ** -0.5
    return (d[:, None] * A * d[None, :]).astype(np.float32)


class MultiInputFeeder(Dataset):
    def __init__(self, root, split, T=288, train=False):
        self.data = np.load(os.path.join(root, f"{split}_data.npy"), mmap_mode="r")   # N, 3, 300, 25, 2
        with open(os.path.join(root, f"{split}_label.pkl"), "rb") as f:
            self.names, self.labels = pickle.load(f)
        self.T, self.train = T, train

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        x = np.array(self.data[i, :, :self.T], dtype=np.float32)                # 3, T, V, M
        if self.train:
            x = x * np.random.uniform(0.9, 1.1, (3, 1, 1, 1)).astype(np.float32)
        joint = np.concatenate([x, x - x[:, :, 1:2]], 0)                        # absolute + relative to spine
        vel = np.zeros((6,) + x.shape[1:], dtype=np.float32)
        vel[:3, :-2] = x[:, 2:] - x[:, :-2]
        vel[3:, :-1] = x[:, 1:] - x[:, :-1]
        bone = np.zeros((6,) + x.shape[1:], dtype=np.float32)
        for a, b in NTU_BONES:
            bone[:3, :, a - 1] = x[:, :, a - 1] - x[:, :, b - 1]
        length = np.linalg.norm(bone[:3], axis=0, keepdims=True) + 1e-4
        bone[3:] = np.arccos(np.clip(bone[:3] / length, -1, 1))
        inp = np.stack([joint, vel, bone])                                      # I=3, C=6, T, V, M
        return torch.from_numpy(inp), int(self.labels[i]), i


class SepTCN(nn.Module):
    def __init__(self, c, stride=1, expand=2):
        super().__init__()
        h = c * expand
        self.net = nn.Sequential(
            nn.Conv2d(c, c, (5, 1), 1, (2, 0), groups=c), nn.BatchNorm2d(c), nn.SiLU(),
            nn.Conv2d(c, h, 1), nn.BatchNorm2d(h),
            nn.Conv2d(h, h, (5, 1), (stride, 1), (2, 0), groups=h), nn.BatchNorm2d(h), nn.SiLU(),
            nn.Conv2d(h, c, 1), nn.BatchNorm2d(c))
        self.res = nn.Identity() if stride == 1 else nn.Sequential(nn.Conv2d(c, c, 1, (stride, 1)), nn.BatchNorm2d(c))

    def forward(self, x):
        return F.silu(self.net(x) + self.res(x))


class GCNLayer(nn.Module):
    def __init__(self, cin, cout, A):
        super().__init__()
        self.register_buffer("A", torch.from_numpy(A))
        self.edge = nn.Parameter(torch.ones_like(self.A))
        self.conv = nn.Conv2d(cin, cout, 1)
        self.bn = nn.BatchNorm2d(cout)
        self.res = nn.Identity() if cin == cout else nn.Sequential(nn.Conv2d(cin, cout, 1), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = torch.einsum("nctv,vw->nctw", self.conv(x), self.A * self.edge)
        return F.silu(self.bn(y) + self.res(x))


class EfficientGCN(nn.Module):
    def __init__(self, num_class=120, num_input=3, in_c=6):
        super().__init__()
        A = make_A()
        self.input_branches = nn.ModuleList([nn.Sequential(
            nn.BatchNorm2d(in_c), GCNLayer(in_c, 64, A), SepTCN(64), GCNLayer(64, 48, A), SepTCN(48),
            GCNLayer(48, 32, A), SepTCN(32)) for _ in range(num_input)])
        self.main = nn.Sequential(GCNLayer(32 * num_input, 128, A), SepTCN(128, 2), GCNLayer(128, 128, A), SepTCN(128),
                                  GCNLayer(128, 256, A), SepTCN(256, 2), GCNLayer(256, 256, A), SepTCN(256))
        self.head = nn.Sequential(nn.Dropout(0.25), nn.Linear(256, num_class))

    def forward(self, x):
        n, i, c, t, v, m = x.shape
        x = x.permute(1, 0, 5, 2, 3, 4).reshape(i, n * m, c, t, v)
        x = torch.cat([branch(x[k]) for k, branch in enumerate(self.input_branches)], 1)
        x = self.main(x)
        return self.head(x.view(n, m, x.shape[1], -1).mean(-1).mean(1))


@torch.no_grad()
def predict_shard(net, loader, device):
    net.eval()
    scores, idx = [], []
    for x, _, i in loader:
        scores.append(net(x.to(device, non_blocking=True)).float())
        idx.append(i.to(device))
    return torch.cat(scores), torch.cat(idx)


def collect(scores, idx, world):
    g_scores = [torch.zeros_like(scores) for _ in range(world)]
    g_idx = [torch.zeros_like(idx) for _ in range(world)]
    dist.all_gather(g_scores, scores)
    dist.all_gather(g_idx, idx)
    return torch.cat(g_scores), torch.cat(g_idx)


def topk_acc(scores, labels):
    top5 = scores.topk(5, 1).indices
    return (top5[:, 0] == labels).float().mean().item(), (top5 == labels[:, None]).any(1).float().mean().item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="data/ntu120/xsub")
    ap.add_argument("--work-dir", default="workdir/efficientgcn_b0_ntu120_xsub")
    ap.add_argument("--epochs", type=int, default=70)
    ap.add_argument("--batch-size", type=int, default=16, help="per GPU")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=10)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN, format="[%(asctime)s] %(message)s")

    train_set = MultiInputFeeder(args.root, "train", train=True)
    test_set = MultiInputFeeder(args.root, "val")
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=8,
                              pin_memory=True, drop_last=True)
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world)), 64,
                             num_workers=8, pin_memory=True)
    labels = torch.as_tensor(np.asarray(test_set.labels), device=device)

    model = EfficientGCN().to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 64
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=1e-4)
    iters = len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (args.warmup * iters))
                                                  * 0.5 * (1 + np.cos(np.pi * s / (args.epochs * iters))))
    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for x, y, _ in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
        scores, idx = predict_shard(model.module, test_loader, device)
        all_scores, all_idx = collect(scores, idx, world)
        top1, top5 = topk_acc(all_scores, labels[all_idx])
        logger.info("epoch %d loss %.4f top1 %.4f top5 %.4f (%.0fs)", epoch + 1, loss.item(), top1, top5,
                    time.time() - tic)
        if rank == 0:
            torch.save(model.module.state_dict(), os.path.join(args.work_dir, "last.pt"))
            if top1 > best:
                best = top1
                torch.save(model.module.state_dict(), os.path.join(args.work_dir, "best.pt"))
        dist.barrier()

    # final: best weights, full test set, scores for late fusion
    state = torch.load(os.path.join(args.work_dir, "best.pt"), map_location=device)
    model.module.load_state_dict(state)
    scores, idx = predict_shard(model.module, test_loader, device)
    all_scores, all_idx = collect(scores, idx, world)
    if rank == 0:
        order = torch.argsort(all_idx)
        fused = {test_set.names[k]: s for k, s in zip(all_idx[order].tolist(), all_scores[order].cpu().numpy())}
        with open(os.path.join(args.work_dir, "test_scores.pkl"), "wb") as f:
            pickle.dump(fused, f)
        logger.info("best top1 %.4f, wrote %d scores", best, len(fused))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
