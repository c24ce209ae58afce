"""GMA (global motion aggregation) training on FlyingThings3D, Sintel validation.

    torchrun --nproc_per_node=8 06_gma_things_trainer.py --stage things \
        --restore_ckpt ckpts/gma-chairs.pth --batch_size 1 --num_steps 120000
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from core.network import RAFTGMA
from core import datasets
from core.utils.utils import InputPadder

MAX_FLOW = 400


def sequence_loss(flow_preds, flow_gt, valid, gamma=0.8):
    n_predictions = len(flow_preds)
    flow_loss = 0.0
    mag = torch.sum(flow_gt ** 2, dim=1, keepdim=True).sqrt()
    valid = (valid[:, None] >= 0.5) & (mag < MAX_FLOW)
    for i in range(n_predictions):
        i_weight = gamma ** (n_predictions - i - 1)
        i_loss = (flow_preds[i] - flow_gt).abs()
        flow_loss += i_weight * (valid * i_loss).mean()
    return flow_loss


class Trainer:
    def __init__(self, args):
        self.args = args
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        np.random.seed(args.seed + self.rank)
        torch.manual_seed(args.seed + self.rank)

        net = RAFTGMA(args)
        if args.restore_ckpt:
            sd = torch.load(args.restore_ckpt, map_location="cpu")
            net.load_state_dict({k.replace("module.", ""): v for k, v in sd.items()}, strict=False)
        net.to(self.device)
        if args.stage != "chairs":
            net.freeze_bn()
        self.model = DDP(net, device_ids=[self.local_rank])

        aug = {"crop_size": args.image_size, "min_scale": -0.4, "max_scale": 0.8, "do_flip": True}
        clean = datasets.FlyingThings3D(aug, dstype="frames_cleanpass")
        final = datasets.FlyingThings3D(aug, dstype="frames_finalpass")
        self.train_set = clean + final
        self.sampler = DistributedSampler(self.train_set, shuffle=True)
        self.loader = DataLoader(self.train_set, batch_size=args.batch_size, sampler=self.sampler,
                                 num_workers=args.workers, pin_memory=True, drop_last=True)

        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.lr,
                                           weight_decay=args.wdecay, eps=1e-8)
        self.scheduler = torch.optim.lr_scheduler.OneCycleLR(
            self.optimizer, args.lr, args.num_steps + 100, pct_start=0.05,
            cycle_momentum=False, anneal_strategy="linear")
        self.scaler = torch.cuda.amp.GradScaler(enabled=args.mixed_precision)
        self.step = 0
        self.best_epe = float("inf")

        if self.rank == 0:
            os.makedirs(args.output, exist_ok=True)
            wandb.init(project="gma-flow", name=args.name, config=vars(args))

    @torch.no_grad()
    def validate_sintel(self, iters=32):
        """Validation is split over the ranks with a DistributedSampler to keep it short."""
        net = self.model.module
        net.eval()
        out = {}
        for dstype in ("clean", "final"):
            val_set = datasets.MpiSintel(split="training", dstype=dstype)
            val_sampler = DistributedSampler(val_set, shuffle=False)
            val_loader = DataLoader(val_set, batch_size=1, sampler=val_sampler, num_workers=2)
            epe_list = []
            for img1, img2, flow_gt, _ in val_loader:
                img1, img2 = img1.to(self.device), img2.to(self.device)
                padder = InputPadder(img1.shape)
                img1, img2 = padder.pad(img1, img2)
                _, flow_pr = net(img1, img2, iters=iters, test_mode=True)
                flow = padder.unpad(flow_pr[0]).cpu()
                epe = torch.sum((flow - flow_gt[0]) ** 2, dim=0).sqrt()
                epe_list.append(epe.view(-1).numpy())
            epe_all = np.concatenate(epe_list)
            out[f"{dstype}/epe"] = float(np.mean(epe_all))
            out[f"{dstype}/1px"] = float(np.mean(epe_all < 1))
            out[f"{dstype}/3px"] = float(np.mean(epe_all < 3))
            out[f"{dstype}/5px"] = float(np.mean(epe_all < 5))
        net.train()
        if self.args.stage != "chairs":
            net.freeze_bn()
        return out

    def save(self, tag):
        if self.rank != 0:
            return
        torch.save({"model": self.model.module.state_dict(),
                    "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(),
                    "step": self.step},
                   os.path.join(self.args.output, f"{self.args.name}_{tag}.pth"))

    def train_step(self, batch):
        img1, img2, flow, valid = [x.to(self.device, non_blocking=True) for x in batch]
        if self.args.add_noise:
            stdv = np.random.uniform(0.0, 5.0)
            img1 = (img1 + stdv * torch.randn_like(img1)).clamp(0.0, 255.0)
            img2 = (img2 + stdv * torch.randn_like(img2)).clamp(0.0, 255.0)
        self.optimizer.zero_grad(set_to_none=True)
        with torch.cuda.amp.autocast(enabled=self.args.mixed_precision):
            preds = self.model(img1, img2, iters=self.args.iters)
        loss = sequence_loss([p.float() for p in preds], flow, valid, self.args.gamma)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        return loss.detach()

    def fit(self):
        epoch = 0
        t0 = time.time()
        loss_sum = torch.zeros((), device=self.device)
        while self.step < self.args.num_steps:
            self.sampler.set_epoch(epoch)
            for batch in self.loader:
                loss_sum += self.train_step(batch)
                self.step += 1
                if self.step % self.args.print_freq == 0:
                    dist.all_reduce(loss_sum)
                    if self.rank == 0:
                        avg = loss_sum.item() / (self.args.print_freq * self.world)
                        wandb.log({"train/loss": avg, "lr": self.scheduler.get_last_lr()[0]}, step=self.step)
                        print(f"step {self.step} loss {avg:.4f} {time.time() - t0:.0f}s", flush=True)
                    loss_sum.zero_()
                if self.step % self.args.val_freq == 0:
                    results = self.validate_sintel()
                    if self.rank == 0:
                        wandb.log(results, step=self.step)
                        self.save(self.step)
                        if results["final/epe"] < self.best_epe:
                            self.best_epe = results["final/epe"]
                            self.save("best")
                    dist.barrier()
                if self.step >= self.args.num_steps:
                    break
            epoch += 1
        self.save("final")
        if self.rank == 0:
            wandb.finish()
        dist.destroy_process_group()


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--name", default="gma-things")
    p.add_argument("--stage", default="things")
    p.add_argument("--restore_ckpt", default=None)
    p.add_argument("--output", default="checkpoints")
    p.add_argument("--lr", type=float, default=1.25e-4)
    p.add_argument("--num_steps", type=int, default=120000)
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--image_size", type=int, nargs=2, default=[400, 720])
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--gamma", type=float, default=0.8)
    p.add_argument("--wdecay", type=float, default=1e-4)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--add_noise", action="store_true")
    p.add_argument("--mixed_precision", action="store_true")
    p.add_argument("--num_heads", type=int, default=1)
    p.add_argument("--position_only", action="store_true")
    p.add_argument("--position_and_content", action="store_true")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--print_freq", type=int, default=100)
    p.add_argument("--val_freq", type=int, default=10000)
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


if __name__ == "__main__":
    Trainer(parse_args()).fit()
