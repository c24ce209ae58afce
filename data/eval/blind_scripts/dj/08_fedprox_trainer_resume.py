"""FedProx trainer with round-level checkpoint/resume.

Each rank is a client holding a Dirichlet(alpha) partition of CIFAR-10. The
global model is the sample-weighted average of the client models. Training can
be preempted and resumed from <work_dir>/latest.pt.

    torchrun --nproc_per_node=8 08_fedprox_trainer_resume.py --work_dir /shared/exp/fedprox_c10 --resume
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.utils.data import DataLoader, Subset
from torchvision import transforms


def vgg11_gn(num_classes=10):
    cfg = [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"]
    layers, c_in = [], 3
    for v in cfg:
        if v == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(c_in, v, 3, padding=1), nn.GroupNorm(32, v), nn.ReLU(inplace=True)]
            c_in = v
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(512, 512), nn.ReLU(inplace=True),
                         nn.Linear(512, num_classes))


class FedProxTrainer:
    def __init__(self, args):
        self.args = args
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        torch.manual_seed(args.seed)

        self._build_data()
        self.model = vgg11_gn().to(self.device)
        self.round = 0
        self.history = []
        self.ckpt_path = os.path.join(args.work_dir, "latest.pt")
        if args.resume and os.path.isfile(self.ckpt_path):
            self._load()
        else:
            self._sync_init()

    def _build_data(self):
        a = self.args
        norm = transforms.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
        train_tf = transforms.Compose([transforms.RandomCrop(32, padding=4),
                                       transforms.RandomHorizontalFlip(),
                                       transforms.ToTensor(), norm])
        test_tf = transforms.Compose([transforms.ToTensor(), norm])
        train = torchvision.datasets.CIFAR10(a.data_dir, train=True, transform=train_tf)
        test = torchvision.datasets.CIFAR10(a.data_dir, train=False, transform=test_tf)

        rng = np.random.default_rng(a.seed)
        y = np.array(train.targets)
        idx_per_client = [[] for _ in range(self.world_size)]
        for c in range(10):
            idx_c = rng.permutation(np.where(y == c)[0])
            prop = rng.dirichlet([a.alpha] * self.world_size)
            cut = (np.cumsum(prop) * len(idx_c)).astype(int)[:-1]
            for k, chunk in enumerate(np.split(idx_c, cut)):
                idx_per_client[k].extend(chunk.tolist())
        self.n_local = len(idx_per_client[self.rank])
        self.train_loader = DataLoader(Subset(train, idx_per_client[self.rank]),
                                       batch_size=a.batch_size, shuffle=True,
                                       num_workers=a.workers, pin_memory=True)
        shard = list(range(self.rank, len(test), self.world_size))
        self.test_loader = DataLoader(Subset(test, shard), batch_size=500, num_workers=2)

    @torch.no_grad()
    def _sync_init(self):
        for t in self.model.state_dict().values():
            dist.broadcast(t, 0)

    def _load(self):
        state = torch.load(self.ckpt_path, map_location=self.device)
        self.model.load_state_dict(state["model"])
        self.round = state["round"]
        self.history = state.get("history", [])
        if self.rank == 0:
            print(f"resumed from {self.ckpt_path} at round {self.round}")

    def _save(self):
        os.makedirs(self.args.work_dir, exist_ok=True)
        state = {"model": self.model.state_dict(), "round": self.round,
                 "history": self.history, "args": vars(self.args)}
        tmp = self.ckpt_path + ".tmp"
        torch.save(state, tmp)
        os.replace(tmp, self.ckpt_path)

    def local_train(self):
        a = self.args
        anchor = [p.detach().clone() for p in self.model.parameters()]
        opt = torch.optim.SGD(self.model.parameters(), lr=a.lr, momentum=0.9, weight_decay=5e-4)
        self.model.train()
        loss_sum, n = 0.0, 0
        for _ in range(a.local_epochs):
            for x, y in self.train_loader:
                x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
                ce = F.cross_entropy(self.model(x), y)
                prox = 0.0
                for p, p0 in zip(self.model.parameters(), anchor):
                    prox = prox + (p - p0).pow(2).sum()
                loss = ce + a.mu / 2 * prox
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                loss_sum += ce.item() * y.size(0)
                n += y.size(0)
        return loss_sum, n

    @torch.no_grad()
    def aggregate(self):
        w = torch.tensor(float(self.n_local), device=self.device)
        tot = w.clone()
        dist.all_reduce(tot)
        for t in self.model.state_dict().values():
            if t.dtype.is_floating_point:
                t.mul_(w / tot)
                dist.all_reduce(t)

    @torch.no_grad()
    def evaluate(self):
        self.model.eval()
        buf = torch.zeros(3, device=self.device)
        for x, y in self.test_loader:
            x, y = x.to(self.device), y.to(self.device)
            logits = self.model(x)
            buf[0] += F.cross_entropy(logits, y, reduction="sum")
            buf[1] += (logits.argmax(1) == y).sum()
            buf[2] += y.numel()
        dist.all_reduce(buf)
        return (buf[0] / buf[2]).item(), (buf[1] / buf[2]).item()

    def fit(self):
        a = self.args
        while self.round < a.rounds:
            t0 = time.time()
            loss_sum, n = self.local_train()
            self.aggregate()
            tl = torch.tensor([loss_sum, float(n)], device=self.device)
            dist.all_reduce(tl)
            self.round += 1
            rec = {"round": self.round, "train_loss": (tl[0] / tl[1]).item()}
            if self.round % a.eval_every == 0:
                rec["test_loss"], rec["test_acc"] = self.evaluate()
            rec["sec"] = round(time.time() - t0, 2)
            self.history.append(rec)
            if self.rank == 0:
                print(json.dumps(rec), flush=True)
            if self.round % a.ckpt_every == 0:
                self._save()
        dist.barrier()

    def close(self):
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", default="/shared/datasets/cifar10")
    ap.add_argument("--work_dir", default="/shared/exp/fedprox_c10")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--local_epochs", type=int, default=2)
    ap.add_argument("--batch_size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--mu", type=float, default=0.001)
    ap.add_argument("--alpha", type=float, default=0.3)
    ap.add_argument("--eval_every", type=int, default=5)
    ap.add_argument("--ckpt_every", type=int, default=5)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=17)
    trainer = FedProxTrainer(ap.parse_args())
    trainer.fit()
    trainer.close()


if __name__ == "__main__":
    main()
