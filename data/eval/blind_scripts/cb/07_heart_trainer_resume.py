"""Left atrium segmentation (MSD Task02_Heart) -- trainer class, DDP, resumable.

Preprocessed volumes (resampled + z-scored) are stored as <case>_img.npy / <case>_seg.npy.

    torchrun --nproc_per_node=2 07_heart_trainer_resume.py --data /data/heart_npy --fold 4 --continue_training
"""
import argparse
import json
import logging
import os
from datetime import datetime

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from monai.inferers import sliding_window_inference
from monai.losses import DiceCELoss
from monai.networks.nets import DynUNet
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class HeartPatchDataset(Dataset):
    def __init__(self, root, cases, patch, oversample=0.33, samples_per_case=4):
        self.root, self.cases, self.patch = root, cases, np.array(patch)
        self.oversample = oversample
        self.index = [c for c in cases for _ in range(samples_per_case)]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        case = self.index[i]
        img = np.load(os.path.join(self.root, f"{case}_img.npy"), mmap_mode="r")
        seg = np.load(os.path.join(self.root, f"{case}_seg.npy"), mmap_mode="r")
        shape = np.array(seg.shape)
        pad = np.maximum(self.patch - shape, 0)
        if pad.any():
            img = np.pad(img, [(p // 2, p - p // 2) for p in pad])
            seg = np.pad(seg, [(p // 2, p - p // 2) for p in pad])
            shape = np.array(seg.shape)
        if np.random.rand() < self.oversample:
            fg = np.argwhere(seg[::2, ::2, ::2] > 0) * 2
            center = fg[np.random.randint(len(fg))] if len(fg) else shape // 2
            lo = np.clip(center - self.patch // 2, 0, shape - self.patch)
        else:
            lo = np.array([np.random.randint(0, s - p + 1) for s, p in zip(shape, self.patch)])
        sl = tuple(slice(a, a + p) for a, p in zip(lo, self.patch))
        x = np.array(img[sl], dtype=np.float32)[None]
        y = np.array(seg[sl], dtype=np.int64)[None]
        for ax in (1, 2, 3):
            if np.random.rand() < 0.5:
                x, y = np.flip(x, ax), np.flip(y, ax)
        if np.random.rand() < 0.15:
            x = x + np.random.normal(0, 0.1, x.shape).astype(np.float32)
        return torch.from_numpy(x.copy()), torch.from_numpy(y.copy())


def worker_init(worker_id):
    seed = torch.initial_seed() % 2 ** 32
    np.random.seed(seed + worker_id)


class Trainer:
    def __init__(self, args):
        self.args = args
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        self.out_dir = os.path.join(args.results, f"fold_{args.fold}")
        if self.rank == 0:
            os.makedirs(self.out_dir, exist_ok=True)
        dist.barrier()
        logging.basicConfig(
            filename=os.path.join(self.out_dir, f"train_log_rank{self.rank}.txt"),
            level=logging.INFO, format="%(asctime)s %(message)s")
        self.log = logging.getLogger("trainer")

        with open(os.path.join(args.data, "splits_final.json")) as f:
            split = json.load(f)[args.fold]
        self.val_cases = split["val"]
        self.patch = (80, 192, 160)
        ds = HeartPatchDataset(args.data, split["train"], self.patch)
        self.sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
        self.loader = DataLoader(ds, batch_size=args.batch_size, sampler=self.sampler, num_workers=6,
                                 pin_memory=True, worker_init_fn=worker_init, persistent_workers=True)

        net = DynUNet(3, 1, 2, kernel_size=[[1, 3, 3], 3, 3, 3, 3, 3],
                      strides=[1, [1, 2, 2], 2, 2, 2, [1, 2, 2]],
                      upsample_kernel_size=[[1, 2, 2], 2, 2, 2, [1, 2, 2]],
                      filters=[32, 64, 128, 256, 320, 320], norm_name="instance",
                      deep_supervision=True, deep_supr_num=3)
        self.net = net.to(self.device)
        self.opt = torch.optim.SGD(self.net.parameters(), lr=args.lr, momentum=0.99, nesterov=True,
                                   weight_decay=3e-5)
        self.scaler = torch.cuda.amp.GradScaler()
        self.loss = DiceCELoss(to_onehot_y=True, softmax=True, batch=True)
        w = np.array([1 / 2 ** i for i in range(4)])
        self.ds_weights = (w / w.sum()).tolist()
        self.epoch, self.best_dice = 0, 0.0
        if args.continue_training:
            self.load_checkpoint(os.path.join(self.out_dir, "checkpoint_latest.pth"))
        self.model = DDP(self.net, device_ids=[self.local_rank])

    def save_checkpoint(self, name):
        if self.rank != 0:
            return
        torch.save({
            "network_weights": self.net.state_dict(),
            "optimizer_state": self.opt.state_dict(),
            "grad_scaler_state": self.scaler.state_dict(),
            "current_epoch": self.epoch,
            "best_dice": self.best_dice,
            "saved_at": datetime.now().isoformat(),
        }, os.path.join(self.out_dir, name))

    def load_checkpoint(self, path):
        ckpt = torch.load(path)
        self.net.load_state_dict(ckpt["network_weights"])
        self.opt.load_state_dict(ckpt["optimizer_state"])
        self.scaler.load_state_dict(ckpt["grad_scaler_state"])
        self.epoch = ckpt["current_epoch"] + 1
        self.best_dice = ckpt["best_dice"]
        self.log.info(f"resumed from {path} (epoch {self.epoch})")

    def poly_lr(self):
        lr = self.args.lr * (1 - self.epoch / self.args.epochs) ** 0.9
        for g in self.opt.param_groups:
            g["lr"] = lr
        return lr

    def train_epoch(self):
        self.model.train()
        self.sampler.set_epoch(self.epoch)
        lr = self.poly_lr()
        total = torch.zeros(2, device=self.device)
        for x, y in self.loader:
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            self.opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                out = self.model(x)
                loss = sum(w * self.loss(out[:, i], y) for i, w in enumerate(self.ds_weights))
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.opt)
            nn.utils.clip_grad_norm_(self.model.parameters(), 12)
            self.scaler.step(self.opt)
            self.scaler.update()
            total += torch.stack([loss.detach().float(), torch.ones((), device=self.device)])
        dist.all_reduce(total)
        return (total[0] / total[1]).item(), lr

    @torch.no_grad()
    def validate(self):
        self.net.eval()
        mine = {}
        for case in self.val_cases[self.rank::self.world]:
            img = np.load(os.path.join(self.args.data, f"{case}_img.npy"))
            seg = np.load(os.path.join(self.args.data, f"{case}_seg.npy"))
            x = torch.from_numpy(img[None, None].astype(np.float32)).to(self.device)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = sliding_window_inference(x, self.patch, 2, self.net, overlap=0.5, mode="gaussian")
            pred = logits.argmax(1)[0].cpu().numpy()
            p, g = pred == 1, seg == 1
            mine[case] = float(2 * (p & g).sum() / max(p.sum() + g.sum(), 1))
        everything = [None] * self.world
        dist.all_gather_object(everything, mine)
        merged = {k: v for d in everything for k, v in d.items()}
        return float(np.mean(list(merged.values()))), merged

    def run(self):
        while self.epoch < self.args.epochs:
            loss, lr = self.train_epoch()
            if self.rank == 0:
                self.log.info(f"epoch {self.epoch} lr {lr:.5f} train loss {loss:.4f}")
            if (self.epoch + 1) % self.args.val_every == 0:
                mean_dice, per_case = self.validate()
                if self.rank == 0:
                    self.log.info(f"epoch {self.epoch} pseudo dice {mean_dice:.4f} over {len(per_case)} cases")
                if mean_dice > self.best_dice:
                    self.best_dice = mean_dice
                    self.save_checkpoint("checkpoint_best.pth")
            if (self.epoch + 1) % self.args.save_every == 0:
                self.save_checkpoint("checkpoint_latest.pth")
            self.epoch += 1
        self.save_checkpoint("checkpoint_final.pth")
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--results", default="results/Task02_Heart")
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--epochs", type=int, default=1000)
    p.add_argument("--batch_size", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--val_every", type=int, default=10)
    p.add_argument("--save_every", type=int, default=50)
    p.add_argument("--continue_training", action="store_true")
    Trainer(p.parse_args()).run()
