#!/usr/bin/env python
# Motion-stream (frame difference) ST-GCN for NTU-120, Processor layout as in the st-gcn repo.
import argparse
import os
import pickle
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
import yaml
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

NTU_PAIRS = [(1, 2), (2, 21), (3, 21), (4, 3), (5, 21), (6, 5), (7, 6), (8, 7), (9, 21),
             (10, 9), (11, 10), (12, 11), (13, 1), (14, 13), (15, 14), (16, 15), (17, 1),
             (18, 17), (19, 18), (20, 19), (22, 23), (23, 8), (24, 25), (25, 12)]


def normalized_adjacency(num_node=25):
    A = np.eye(num_node, dtype=np.float32)
    for i, j in NTU_PAIRS:
        A[i - 1, j - 1] = A[j - 1, i - 1] = 1
    Dl = A.sum(0)
    return (A / Dl[None, :]).astype(np.float32)


class Feeder(Dataset):
    """Feeder for the st-gcn style (N, C, T, V, M) arrays + pickled (names, labels)."""

    def __init__(self, data_path, label_path, stream="motion", window_size=100, random_shift=False, mmap=True):
        with open(label_path, "rb") as f:
            self.sample_name, self.label = pickle.load(f)
        self.data = np.load(data_path, mmap_mode="r" if mmap else None)
        self.stream = stream
        self.window_size = window_size
        self.random_shift = random_shift

    def __len__(self):
        return len(self.label)

    def __getitem__(self, index):
        data = np.array(self.data[index])
        frames = (np.abs(data).sum(axis=(0, 2, 3)) > 0).sum()
        frames = max(int(frames), 2)
        data = data[:, :frames]
        if self.random_shift and frames > self.window_size:
            begin = np.random.randint(0, frames - self.window_size + 1)
            data = data[:, begin:begin + self.window_size]
        idx = np.linspace(0, data.shape[1] - 1, self.window_size).astype(np.int64)
        data = data[:, idx]
        if self.stream == "motion":
            motion = np.zeros_like(data)
            motion[:, :-1] = data[:, 1:] - data[:, :-1]
            data = motion
        return torch.from_numpy(data.astype(np.float32)), int(self.label[index])


class GraphConvBlock(nn.Module):
    def __init__(self, cin, cout, A, stride=1, dropout=0.0):
        super().__init__()
        self.register_buffer("A", torch.from_numpy(A))
        self.edge = nn.Parameter(torch.ones_like(self.A))
        self.gconv = nn.Conv2d(cin, cout, 1)
        self.tconv = nn.Sequential(nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
                                   nn.Conv2d(cout, cout, (9, 1), (stride, 1), (4, 0)),
                                   nn.BatchNorm2d(cout), nn.Dropout(dropout))
        self.res = (nn.Identity() if cin == cout and stride == 1
                    else nn.Sequential(nn.Conv2d(cin, cout, 1, (stride, 1)), nn.BatchNorm2d(cout)))

    def forward(self, x):
        y = torch.einsum("nctv,vw->nctw", self.gconv(x), self.A * self.edge)
        return torch.relu(self.tconv(y) + self.res(x))


class Model(nn.Module):
    def __init__(self, num_class=120, in_channels=3, num_person=2, dropout=0.5):
        super().__init__()
        A = normalized_adjacency()
        self.data_bn = nn.BatchNorm1d(in_channels * 25 * num_person)
        plan = [(in_channels, 64, 1), (64, 64, 1), (64, 64, 1), (64, 64, 1), (64, 128, 2),
                (128, 128, 1), (128, 128, 1), (128, 256, 2), (256, 256, 1), (256, 256, 1)]
        self.net = nn.Sequential(*[GraphConvBlock(ci, co, A, s, dropout if k else 0.0)
                                   for k, (ci, co, s) in enumerate(plan)])
        self.fc = nn.Linear(256, num_class)

    def forward(self, x):
        N, C, T, V, M = x.size()
        x = x.permute(0, 4, 3, 1, 2).contiguous().view(N, M * V * C, T)
        x = self.data_bn(x)
        x = x.view(N, M, V, C, T).permute(0, 1, 3, 4, 2).contiguous().view(N * M, C, T, V)
        x = self.net(x)
        x = x.view(N, M, x.size(1), -1).mean(3).mean(1)
        return self.fc(x)


class Processor:
    def __init__(self, arg):
        self.arg = arg
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group(backend="nccl")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        self.load_data()
        self.load_model()
        self.load_optimizer()
        self.best_acc = 0.0
        if self.rank == 0:
            os.makedirs(arg.work_dir, exist_ok=True)
            shutil.copy(arg.config, arg.work_dir)

    def print_log(self, msg):
        if self.rank == 0:
            msg = time.strftime("[%m.%d.%y|%X] ") + msg
            print(msg, flush=True)
            with open(os.path.join(self.arg.work_dir, "log.txt"), "a") as f:
                f.write(msg + "\n")

    def load_data(self):
        a = self.arg
        self.train_set = Feeder(**a.train_feeder_args)
        self.test_set = Feeder(**a.test_feeder_args)
        self.train_sampler = DistributedSampler(self.train_set, shuffle=True, seed=a.seed)
        self.train_loader = DataLoader(self.train_set, batch_size=a.batch_size // self.world_size,
                                       sampler=self.train_sampler, num_workers=a.num_worker,
                                       pin_memory=True, drop_last=True)
        # test shard without DistributedSampler padding, so the reduced counts cover each sample once
        shard = list(range(self.rank, len(self.test_set), self.world_size))
        self.test_loader = DataLoader(torch.utils.data.Subset(self.test_set, shard),
                                      batch_size=a.test_batch_size, num_workers=a.num_worker)

    def load_model(self):
        model = Model(**self.arg.model_args)
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(self.device)
        self.model = DistributedDataParallel(model, device_ids=[self.local_rank], output_device=self.local_rank)
        self.loss = nn.CrossEntropyLoss().to(self.device)

    def load_optimizer(self):
        a = self.arg
        self.optimizer = optim.SGD(self.model.parameters(), lr=a.base_lr, momentum=0.9,
                                   nesterov=a.nesterov, weight_decay=a.weight_decay)

    def adjust_learning_rate(self, epoch):
        a = self.arg
        if epoch < a.warm_up_epoch:
            lr = a.base_lr * (epoch + 1) / a.warm_up_epoch
        else:
            lr = a.base_lr * (0.1 ** np.sum(epoch >= np.array(a.step)))
        for param_group in self.optimizer.param_groups:
            param_group["lr"] = lr
        return lr

    def train(self, epoch):
        self.model.train()
        self.train_sampler.set_epoch(epoch)
        lr = self.adjust_learning_rate(epoch)
        losses, tic = [], time.time()
        for data, label in self.train_loader:
            data = data.to(self.device, non_blocking=True)
            label = label.to(self.device, non_blocking=True)
            output = self.model(data)
            loss = self.loss(output, label)
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
            losses.append(loss.item())
        self.print_log(f"Training epoch {epoch + 1}: lr {lr:.4f}, mean loss (rank 0) {np.mean(losses):.4f}, "
                       f"{time.time() - tic:.0f}s")

    @torch.no_grad()
    def eval(self, epoch):
        net = self.model.module
        net.eval()
        correct_1 = correct_5 = n = 0
        for data, label in self.test_loader:
            data = data.to(self.device, non_blocking=True)
            label = label.to(self.device, non_blocking=True)
            rank5 = net(data).topk(5, 1)[1]
            correct_1 += (rank5[:, 0] == label).sum().item()
            correct_5 += (rank5 == label.unsqueeze(1)).any(1).sum().item()
            n += label.size(0)
        counts = torch.tensor([correct_1, correct_5, n], dtype=torch.float64)
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
        top1, top5 = (counts[0] / counts[2]).item(), (counts[1] / counts[2]).item()
        self.print_log(f"Eval epoch {epoch + 1}: top1 {100 * top1:.2f}% top5 {100 * top5:.2f}% "
                       f"({int(counts[2])} samples)")
        if top1 > self.best_acc:
            self.best_acc = top1
            if self.rank == 0:
                torch.save(net.state_dict(), os.path.join(self.arg.work_dir, "best_model.pt"))

    def start(self):
        for epoch in range(self.arg.start_epoch, self.arg.num_epoch):
            self.train(epoch)
            if (epoch + 1) % self.arg.eval_interval == 0 or epoch + 1 == self.arg.num_epoch:
                self.eval(epoch)
            if self.rank == 0 and (epoch + 1) % self.arg.save_interval == 0:
                torch.save({"epoch": epoch + 1, "model": self.model.module.state_dict(),
                            "optimizer": self.optimizer.state_dict()},
                           os.path.join(self.arg.work_dir, f"epoch-{epoch + 1}.pt"))
        self.print_log(f"Best top1: {100 * self.best_acc:.2f}%")
        dist.destroy_process_group()


def get_parser():
    parser = argparse.ArgumentParser(description="Spatial Temporal Graph Convolution Network (motion)")
    parser.add_argument("--config", default="config/ntu120_xsub/train_motion.yaml")
    parser.add_argument("--work-dir", dest="work_dir", default="./work_dir/ntu120/xsub/motion")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--num-worker", dest="num_worker", type=int, default=8)
    parser.add_argument("--batch-size", dest="batch_size", type=int, default=64)
    parser.add_argument("--test-batch-size", dest="test_batch_size", type=int, default=64)
    parser.add_argument("--base-lr", dest="base_lr", type=float, default=0.1)
    parser.add_argument("--step", type=int, nargs="+", default=[35, 55])
    parser.add_argument("--warm-up-epoch", dest="warm_up_epoch", type=int, default=5)
    parser.add_argument("--num-epoch", dest="num_epoch", type=int, default=65)
    parser.add_argument("--start-epoch", dest="start_epoch", type=int, default=0)
    parser.add_argument("--weight-decay", dest="weight_decay", type=float, default=4e-4)
    parser.add_argument("--nesterov", action="store_true", default=True)
    parser.add_argument("--eval-interval", dest="eval_interval", type=int, default=5)
    parser.add_argument("--save-interval", dest="save_interval", type=int, default=10)
    parser.add_argument("--model-args", dest="model_args", type=dict, default={})
    parser.add_argument("--train-feeder-args", dest="train_feeder_args", type=dict, default={})
    parser.add_argument("--test-feeder-args", dest="test_feeder_args", type=dict, default={})
    return parser


if __name__ == "__main__":
    parser = get_parser()
    p = parser.parse_args()
    if p.config is not None:
        with open(p.config) as f:
            default_arg = yaml.safe_load(f)
        parser.set_defaults(**default_arg)
    arg = parser.parse_args()
    torch.manual_seed(arg.seed)
    np.random.seed(arg.seed)
    Processor(arg).start()
