"""RAFT training on FlyingThings3D with resumable checkpoints.

    torchrun --nproc_per_node=4 train_things.py --name raft-things \
        --restore_ckpt checkpoints/raft-chairs.pth --resume auto
"""
import argparse
import glob
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from core.datasets import FlyingThings3D, MpiSintel
from core.raft import RAFT
from core.utils.utils import InputPadder

log = logging.getLogger(__name__)


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", default="raft-things")
    parser.add_argument("--restore_ckpt", default=None, help="weights only, e.g. the chairs model")
    parser.add_argument("--resume", default=None, help="path to a training state, or 'auto'")
    parser.add_argument("--ckpt_dir", default="checkpoints")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--lr", type=float, default=1.25e-4)
    parser.add_argument("--num_steps", type=int, default=100000)
    parser.add_argument("--batch_size", type=int, default=8, help="global")
    parser.add_argument("--image_size", type=int, nargs=2, default=[400, 720])
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--wdecay", type=float, default=1e-4)
    parser.add_argument("--gamma", type=float, default=0.8)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--mixed_precision", action="store_true")
    parser.add_argument("--alternate_corr", action="store_true")
    parser.add_argument("--save_every", type=int, default=10000)
    return parser.parse_args()


def sequence_loss(preds, gt, valid, gamma, max_flow=400.0):
    valid = (valid >= 0.5) & (gt.pow(2).sum(1).sqrt() < max_flow)
    n = len(preds)
    loss = sum(gamma ** (n - i - 1) * (valid[:, None] * (p - gt).abs()).mean() for i, p in enumerate(preds))
    epe = (preds[-1] - gt).pow(2).sum(1).sqrt()[valid]
    return loss, epe


class Trainer:
    def __init__(self, args):
        self.args = args
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        self.is_main = self.rank == 0

        model = RAFT(args)
        if args.restore_ckpt:
            sd = torch.load(args.restore_ckpt, map_location="cpu")
            model.load_state_dict({k.replace("module.", ""): v for k, v in sd.items()}, strict=False)
        model = model.to(self.device)
        self.model = DDP(model, device_ids=[self.local_rank])
        self.model.module.freeze_bn()

        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.lr, weight_decay=args.wdecay, eps=1e-8)
        self.scheduler = torch.optim.lr_scheduler.OneCycleLR(
            self.optimizer, args.lr, args.num_steps + 100, pct_start=0.05,
            cycle_momentum=False, anneal_strategy="linear")
        self.scaler = torch.cuda.amp.GradScaler(enabled=args.mixed_precision)
        self.step = 0
        self.epoch = 0

        aug = {"crop_size": args.image_size, "min_scale": -0.4, "max_scale": 0.8, "do_flip": True}
        clean = FlyingThings3D(aug, dstype="frames_cleanpass")
        final = FlyingThings3D(aug, dstype="frames_finalpass")
        self.train_set = clean + final
        self.sampler = DistributedSampler(self.train_set, shuffle=True, drop_last=True)
        self.loader = DataLoader(self.train_set, batch_size=args.batch_size // self.world, sampler=self.sampler,
                                 num_workers=4, pin_memory=True, drop_last=True)
        self.writer = SummaryWriter(os.path.join("runs", args.name)) if self.is_main else None

    def state_path(self, step):
        return os.path.join(self.args.ckpt_dir, f"{self.args.name}_state_{step:06d}.pth")

    def save_state(self):
        if not self.is_main:
            return
        os.makedirs(self.args.ckpt_dir, exist_ok=True)
        torch.save({
            "model": self.model.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "step": self.step,
            "epoch": self.epoch,
        }, self.state_path(self.step))
        log.info("saved training state at step %d", self.step)

    def load_state(self, path):
        if path == "auto":
            found = sorted(glob.glob(os.path.join(self.args.ckpt_dir, f"{self.args.name}_state_*.pth")))
            if not found:
                return
            path = found[-1]
        state = torch.load(path)
        self.model.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.step = state["step"]
        self.epoch = state["epoch"]
        if self.is_main:
            log.info("resumed from %s (step %d)", path, self.step)

    @torch.no_grad()
    def validate(self):
        net = self.model.module
        net.eval()
        results = {}
        for dstype in ("clean", "final"):
            ds = MpiSintel(split="training", dstype=dstype)
            tot = torch.zeros(2, device=self.device)
            for i in range(self.rank, len(ds), self.world):
                img1, img2, flow_gt, _ = ds[i]
                img1, img2 = img1[None].to(self.device), img2[None].to(self.device)
                padder = InputPadder(img1.shape)
                img1, img2 = padder.pad(img1, img2)
                _, flow = net(img1, img2, iters=32, test_mode=True)
                epe = (padder.unpad(flow[0]) - flow_gt.to(self.device)).pow(2).sum(0).sqrt()
                tot += torch.stack([epe.sum(), torch.tensor(float(epe.numel()), device=self.device)])
            dist.all_reduce(tot)
            results[dstype] = (tot[0] / tot[1]).item()
        net.train()
        net.freeze_bn()
        return results

    def train(self):
        args = self.args
        self.model.train()
        self.model.module.freeze_bn()
        meter = torch.zeros(3, device=self.device)
        t0 = time.time()
        while self.step < args.num_steps:
            self.sampler.set_epoch(self.epoch)
            for img1, img2, flow, valid in self.loader:
                img1, img2 = img1.to(self.device, non_blocking=True), img2.to(self.device, non_blocking=True)
                flow, valid = flow.to(self.device, non_blocking=True), valid.to(self.device, non_blocking=True)
                self.optimizer.zero_grad(set_to_none=True)
                with torch.cuda.amp.autocast(enabled=args.mixed_precision):
                    preds = self.model(img1, img2, iters=args.iters)
                loss, epe = sequence_loss(preds, flow, valid, args.gamma)
                self.scaler.scale(loss).backward()
                self.scaler.unscale_(self.optimizer)
                nn.utils.clip_grad_norm_(self.model.parameters(), args.clip)
                self.scaler.step(self.optimizer)
                self.scaler.update()
                self.scheduler.step()
                self.step += 1

                meter += torch.stack([loss.detach().float(), epe.sum().float(), torch.tensor(float(epe.numel()), device=self.device)])
                if self.step % 200 == 0:
                    dist.all_reduce(meter)
                    if self.is_main:
                        l, e = meter[0].item() / (200 * self.world), meter[1].item() / max(meter[2].item(), 1)
                        log.info("step %d  loss %.3f  epe %.3f  %.1f s", self.step, l, e, time.time() - t0)
                        self.writer.add_scalar("loss", l, self.step)
                        self.writer.add_scalar("epe", e, self.step)
                    meter.zero_()
                    t0 = time.time()

                if self.step % args.save_every == 0:
                    res = self.validate()
                    if self.is_main:
                        log.info("sintel val: %s", res)
                        for k, v in res.items():
                            self.writer.add_scalar(f"val/{k}", v, self.step)
                    self.save_state()
                    dist.barrier()
                if self.step >= args.num_steps:
                    break
            self.epoch += 1

        if self.is_main:
            torch.save(self.model.module.state_dict(), os.path.join(args.ckpt_dir, f"{args.name}.pth"))
            self.writer.close()


def main():
    args = get_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    trainer = Trainer(args)
    if args.resume:
        trainer.load_state(args.resume)
    trainer.train()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
