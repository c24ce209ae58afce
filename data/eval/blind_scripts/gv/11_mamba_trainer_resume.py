"""
Mamba-1 LM trainer with resumable checkpoints (preemptible queue).

The job is requeued by the scheduler after preemption and picks up from
<run_dir>/latest.pt when it exists.

    torchrun --nproc_per_node=8 11_mamba_trainer_resume.py --run_dir /checkpoints/mamba_1.4b_pg19
"""
import argparse
import glob
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from mamba_ssm.models.config_mamba import MambaConfig
from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel


class ChunkedBooks(Dataset):
    """PG-19 books tokenized to one uint16 file per book; each item is a seq_len+1 window."""

    def __init__(self, root, seq_len):
        self.seq_len = seq_len
        self.books = [np.memmap(f, dtype=np.uint16, mode="r") for f in sorted(glob.glob(f"{root}/*.bin"))]
        self.index = []
        for b, arr in enumerate(self.books):
            for s in range(0, len(arr) - seq_len - 1, seq_len):
                self.index.append((b, s))

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        b, s = self.index[i]
        w = torch.from_numpy(self.books[b][s:s + self.seq_len + 1].astype(np.int64))
        return w[:-1], w[1:]


class Trainer:
    def __init__(self, args):
        self.args = args
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.device = torch.device("cuda", self.local_rank)
        self.is_main = self.rank == 0

        cfg = MambaConfig(d_model=args.d_model, n_layer=args.n_layer, vocab_size=args.vocab_size,
                          ssm_cfg={"d_state": 16, "expand": 2}, rms_norm=True,
                          residual_in_fp32=True, fused_add_norm=True)
        model = MambaLMHeadModel(cfg, device=self.device)
        self.model = DDP(model, device_ids=[self.local_rank])
        self.opt = torch.optim.AdamW(self._param_groups(), lr=args.lr, betas=(0.9, 0.95), fused=True)
        self.step = 0
        self.epoch = 0
        self.best_val = float("inf")

        self.train_ds = ChunkedBooks(os.path.join(args.data_root, "train"), args.seq_len)
        self.val_ds = ChunkedBooks(os.path.join(args.data_root, "validation"), args.seq_len)
        self.sampler = DistributedSampler(self.train_ds, shuffle=True, seed=args.seed, drop_last=True)
        self.loader = DataLoader(self.train_ds, batch_size=args.batch_size, sampler=self.sampler,
                                 num_workers=6, pin_memory=True, drop_last=True)
        val_sub = torch.utils.data.Subset(self.val_ds, range(self.rank, len(self.val_ds), self.world))
        self.val_loader = DataLoader(val_sub, batch_size=args.batch_size, num_workers=2)

    def _param_groups(self):
        decay, no_decay = [], []
        for n, p in self.model.module.named_parameters():
            if getattr(p, "_no_weight_decay", False) or p.dim() < 2:
                no_decay.append(p)
            else:
                decay.append(p)
        return [{"params": decay, "weight_decay": self.args.wd},
                {"params": no_decay, "weight_decay": 0.0}]

    def lr(self):
        a = self.args
        if self.step < a.warmup:
            return a.lr * (self.step + 1) / a.warmup
        t = min(1.0, (self.step - a.warmup) / max(1, a.max_steps - a.warmup))
        return a.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * t)))

    # ------------------------------------------------------------ checkpointing
    def save(self, name):
        if not self.is_main:
            return
        state = {
            "model": self.model.module.state_dict(),
            "opt": self.opt.state_dict(),
            "step": self.step,
            "epoch": self.epoch,
            "best_val": self.best_val,
            "args": vars(self.args),
        }
        tmp = os.path.join(self.args.run_dir, name + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, os.path.join(self.args.run_dir, name))

    def maybe_resume(self):
        path = os.path.join(self.args.run_dir, "latest.pt")
        if not os.path.exists(path):
            return
        ckpt = torch.load(path)
        self.model.module.load_state_dict(ckpt["model"])
        self.opt.load_state_dict(ckpt["opt"])
        self.step, self.epoch, self.best_val = ckpt["step"], ckpt["epoch"], ckpt["best_val"]
        if self.is_main:
            print(f"resumed from {path} at step {self.step} (epoch {self.epoch})")

    # ------------------------------------------------------------ loops
    @torch.no_grad()
    def evaluate(self):
        self.model.eval()
        acc = torch.zeros(2, device=self.device, dtype=torch.float64)
        for i, (x, y) in enumerate(self.val_loader):
            if i >= self.args.eval_batches:
                break
            x, y = x.to(self.device), y.to(self.device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = self.model.module(x).logits
            acc[0] += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")
            acc[1] += y.numel()
        dist.all_reduce(acc)
        self.model.train()
        return (acc[0] / acc[1]).item()

    def train(self):
        a = self.args
        steps_per_epoch = len(self.loader)
        t0 = time.time()
        while self.step < a.max_steps:
            self.sampler.set_epoch(self.epoch)
            skip = self.step - self.epoch * steps_per_epoch
            for i, (x, y) in enumerate(self.loader):
                if i < skip:
                    continue
                x = x.to(self.device, non_blocking=True)
                y = y.to(self.device, non_blocking=True)
                for g in self.opt.param_groups:
                    g["lr"] = self.lr()
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = self.model(x).logits
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(), a.clip)
                self.opt.step()
                self.step += 1

                if self.step % a.log_every == 0:
                    l = loss.detach()
                    dist.all_reduce(l, op=dist.ReduceOp.AVG)
                    if self.is_main:
                        sps = a.log_every / (time.time() - t0)
                        print(f"[{self.step}] loss={l.item():.4f} gnorm={gn.item():.2f} "
                              f"lr={self.lr():.2e} steps/s={sps:.2f}", flush=True)
                    t0 = time.time()

                if self.step % a.eval_every == 0:
                    val = self.evaluate()
                    if self.is_main:
                        print(f"[{self.step}] val_loss={val:.4f} ppl={math.exp(val):.2f}", flush=True)
                    if val < self.best_val:
                        self.best_val = val
                        self.save("best.pt")

                if self.step % a.save_every == 0:
                    self.save("latest.pt")
                    dist.barrier()

                if self.step >= a.max_steps:
                    break
            else:
                self.epoch += 1
        self.save("latest.pt")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data_root", default="/data/pg19_tok")
    p.add_argument("--run_dir", required=True)
    p.add_argument("--d_model", type=int, default=2048)
    p.add_argument("--n_layer", type=int, default=48)
    p.add_argument("--vocab_size", type=int, default=50280)
    p.add_argument("--seq_len", type=int, default=8192)
    p.add_argument("--batch_size", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--wd", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--warmup", type=int, default=1000)
    p.add_argument("--max_steps", type=int, default=100000)
    p.add_argument("--log_every", type=int, default=25)
    p.add_argument("--eval_every", type=int, default=1000)
    p.add_argument("--eval_batches", type=int, default=50)
    p.add_argument("--save_every", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.manual_seed(args.seed)
    os.makedirs(args.run_dir, exist_ok=True)

    trainer = Trainer(args)
    trainer.maybe_resume()
    trainer.train()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
