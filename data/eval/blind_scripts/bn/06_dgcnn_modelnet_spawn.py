"""
DGCNN on ModelNet40 (HDF5, 2048 points), one process per GPU via mp.spawn.

    python main_dgcnn.py --exp_name dgcnn_1024 --num_points 1024 --k 20 --batch_size 16
"""
import argparse
import glob
import os
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def load_h5(root, partition):
    data, label = [], []
    for f in sorted(glob.glob(os.path.join(root, "modelnet40_ply_hdf5_2048", f"ply_data_{partition}*.h5"))):
        with h5py.File(f, "r") as h:
            data.append(h["data"][:].astype("float32"))
            label.append(h["label"][:].astype("int64"))
    return np.concatenate(data), np.concatenate(label).squeeze(-1)


def translate_pointcloud(pc):
    xyz1 = np.random.uniform(2.0 / 3.0, 3.0 / 2.0, size=[3])
    xyz2 = np.random.uniform(-0.2, 0.2, size=[3])
    return np.add(np.multiply(pc, xyz1), xyz2).astype("float32")


class ModelNet40H5(Dataset):
    def __init__(self, root, num_points, partition="train"):
        self.data, self.label = load_h5(root, partition)
        self.num_points, self.partition = num_points, partition

    def __getitem__(self, item):
        pc = self.data[item][: self.num_points]
        if self.partition == "train":
            pc = translate_pointcloud(pc)
            np.random.shuffle(pc)
        return pc, self.label[item]

    def __len__(self):
        return self.data.shape[0]


def knn(x, k):
    inner = -2 * torch.matmul(x.transpose(2, 1), x)
    xx = torch.sum(x ** 2, dim=1, keepdim=True)
    pairwise = -xx - inner - xx.transpose(2, 1)
    return pairwise.topk(k=k, dim=-1)[1]


def get_graph_feature(x, k):
    b, c, n = x.shape
    idx = knn(x, k) + torch.arange(b, device=x.device).view(-1, 1, 1) * n
    x = x.transpose(2, 1).contiguous()
    feature = x.view(b * n, -1)[idx.view(-1)].view(b, n, k, c)
    x = x.view(b, n, 1, c).expand(-1, -1, k, -1)
    return torch.cat((feature - x, x), dim=3).permute(0, 3, 1, 2).contiguous()


class DGCNN(nn.Module):
    def __init__(self, k=20, emb_dims=1024, dropout=0.5, num_classes=40):
        super().__init__()
        self.k = k

        def edge(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout), nn.LeakyReLU(0.2))

        self.conv1, self.conv2 = edge(6, 64), edge(128, 64)
        self.conv3, self.conv4 = edge(128, 128), edge(256, 256)
        self.conv5 = nn.Sequential(nn.Conv1d(512, emb_dims, 1, bias=False), nn.BatchNorm1d(emb_dims),
                                   nn.LeakyReLU(0.2))
        self.head = nn.Sequential(
            nn.Linear(emb_dims * 2, 512, bias=False), nn.BatchNorm1d(512), nn.LeakyReLU(0.2), nn.Dropout(dropout),
            nn.Linear(512, 256), nn.BatchNorm1d(256), nn.LeakyReLU(0.2), nn.Dropout(dropout),
            nn.Linear(256, num_classes))

    def forward(self, x):
        x1 = self.conv1(get_graph_feature(x, self.k)).max(dim=-1)[0]
        x2 = self.conv2(get_graph_feature(x1, self.k)).max(dim=-1)[0]
        x3 = self.conv3(get_graph_feature(x2, self.k)).max(dim=-1)[0]
        x4 = self.conv4(get_graph_feature(x3, self.k)).max(dim=-1)[0]
        x = self.conv5(torch.cat((x1, x2, x3, x4), dim=1))
        x = torch.cat((F.adaptive_max_pool1d(x, 1).flatten(1), F.adaptive_avg_pool1d(x, 1).flatten(1)), 1)
        return self.head(x)


def smooth_ce(pred, gold, eps=0.2):
    n_class = pred.size(1)
    one_hot = torch.zeros_like(pred).scatter(1, gold.view(-1, 1), 1)
    one_hot = one_hot * (1 - eps) + (1 - one_hot) * eps / (n_class - 1)
    return -(one_hot * F.log_softmax(pred, dim=1)).sum(dim=1).mean()


def strip_module(state_dict):
    return {k[len("module."):] if k.startswith("module.") else k: v for k, v in state_dict.items()}


@torch.no_grad()
def test(net, loader, device):
    net.eval()
    preds, trues = [], []
    for data, label in loader:
        logits = net(data.to(device).permute(0, 2, 1))
        preds.append(logits.argmax(1).cpu())
        trues.append(label)
    preds, trues = torch.cat(preds).numpy(), torch.cat(trues).numpy()
    acc = (preds == trues).mean()
    per_class = [np.mean(preds[trues == c] == c) for c in np.unique(trues)]
    return acc, float(np.mean(per_class))


def main_worker(gpu, ngpus, args):
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}", world_size=ngpus, rank=gpu)
    device = torch.device("cuda", gpu)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed + gpu)

    train_set = ModelNet40H5(args.data_root, args.num_points, "train")
    sampler = DistributedSampler(train_set, num_replicas=ngpus, rank=gpu, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    test_loader = None
    if gpu == 0:
        test_loader = DataLoader(ModelNet40H5(args.data_root, args.num_points, "test"),
                                 batch_size=args.test_batch_size, num_workers=4)

    model = DGCNN(args.k, args.emb_dims, args.dropout)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[gpu])

    # reference recipe: SGD lr 0.1 for a batch of 32; keep lr / batch constant
    lr = 0.1 * args.batch_size * ngpus / 32
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs, eta_min=lr * 0.01)

    ckpt_dir = os.path.join("checkpoints", args.exp_name)
    start_epoch, best_acc = 0, 0.0
    if args.resume and os.path.isfile(os.path.join(ckpt_dir, "last.t7")):
        ckpt = torch.load(os.path.join(ckpt_dir, "last.t7"), map_location="cpu")
        model.module.load_state_dict(strip_module(ckpt["model"]))
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch, best_acc = ckpt["epoch"] + 1, ckpt["best_acc"]
    if gpu == 0:
        os.makedirs(ckpt_dir, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        meter = torch.zeros(3, device=device)
        for data, label in train_loader:
            data = data.to(device, non_blocking=True).permute(0, 2, 1)
            label = label.to(device, non_blocking=True)
            logits = model(data)
            loss = smooth_ce(logits, label)
            opt.zero_grad()
            loss.backward()
            opt.step()
            meter += torch.stack([loss.detach() * len(label), (logits.argmax(1) == label).sum().float(),
                                  torch.tensor(float(len(label)), device=device)])
        sched.step()
        dist.all_reduce(meter)

        if gpu == 0:
            acc, avg_acc = test(model.module, test_loader, device)
            if acc > best_acc:
                best_acc = acc
                torch.save(model.module.state_dict(), os.path.join(ckpt_dir, "best.t7"))
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "best_acc": best_acc}, os.path.join(ckpt_dir, "last.t7"))
            print(f"epoch {epoch} loss {meter[0].item() / meter[2].item():.4f} "
                  f"train acc {meter[1].item() / meter[2].item():.4f} test acc {acc:.4f} "
                  f"avg acc {avg_acc:.4f} best {best_acc:.4f} [{time.time() - t0:.0f}s]", flush=True)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="DGCNN ModelNet40")
    parser.add_argument("--exp_name", default="dgcnn")
    parser.add_argument("--data_root", default="data")
    parser.add_argument("--batch_size", type=int, default=16, help="per GPU")
    parser.add_argument("--test_batch_size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=250)
    parser.add_argument("--num_points", type=int, default=1024)
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument("--emb_dims", type=int, default=1024)
    parser.add_argument("--dropout", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--port", type=int, default=23456)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    ngpus = torch.cuda.device_count()
    mp.spawn(main_worker, nprocs=ngpus, args=(ngpus, args))
