"""Continue-pretraining GPT-2 medium on a domain corpus.

DDP + ZeroRedundancyOptimizer (AdamW states sharded across ranks), launched with
    torchrun --nnodes=2 --nproc-per-node=8 --max-restarts=5 --rdzv-backend=c10d ...
so that a lost node or a preemption restarts every worker from the latest
checkpoint in the shared run directory.
"""
import argparse
import json
import math
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from datasets import load_from_disk
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import GPT2LMHeadModel, get_cosine_schedule_with_warmup

TERM = False


def on_term(sig, frame):
    global TERM
    TERM = True


def cli():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", required=True, help="load_from_disk dir with input_ids blocks")
    ap.add_argument("--init", default="gpt2-medium")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--batch-size", type=int, default=8, help="per rank")
    ap.add_argument("--lr", type=float, default=1.5e-4, help="for 2 nodes x 8 GPUs x 8 = 128 seqs/step")
    ap.add_argument("--warmup-steps", type=int, default=1000)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--save-interval", type=int, default=1000)
    ap.add_argument("--eval-interval", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=17)
    return ap.parse_args()


def collate(rows):
    ids = torch.stack([torch.as_tensor(r["input_ids"]) for r in rows])
    return {"input_ids": ids, "labels": ids.clone()}


class Trainer:
    def __init__(self, args):
        self.args = args
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        self.device = torch.device("cuda", self.local_rank)
        dist.init_process_group("nccl", timeout=timedelta(minutes=20))
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        torch.manual_seed(args.seed)

        data = load_from_disk(args.dataset)
        self.train_ds, self.val_ds = data["train"], data["validation"]
        self.sampler = DistributedSampler(self.train_ds, shuffle=True, seed=args.seed, drop_last=True)
        self.val_loader = DataLoader(self.val_ds, batch_size=args.batch_size, collate_fn=collate,
                                     sampler=DistributedSampler(self.val_ds, shuffle=False, drop_last=True))

        model = GPT2LMHeadModel.from_pretrained(args.init)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        self.model = DDP(model.to(self.device), device_ids=[self.local_rank])
        self.optimizer = ZeroRedundancyOptimizer(self.model.parameters(), optimizer_class=torch.optim.AdamW,
                                                 lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
        self.steps_per_epoch = len(self.sampler) // args.batch_size
        self.total_steps = self.steps_per_epoch * args.epochs
        self.scheduler = get_cosine_schedule_with_warmup(self.optimizer, args.warmup_steps, self.total_steps)
        self.step = 0
        self.epoch = 0
        self.batch_in_epoch = 0

    # ---------------------------------------------------------------- state
    def save_checkpoint(self):
        if self.rank == 0:
            self.optimizer.consolidate_state_dict(to=0)
            state = {
                "model": self.model.module.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "step": self.step,
                "epoch": self.epoch,
                "batch_in_epoch": self.batch_in_epoch,
            }
            path = os.path.join(self.args.run_dir, f"ckpt_{self.step:07d}.pt")
            torch.save(state, path + ".tmp")
            os.replace(path + ".tmp", path)
            with open(os.path.join(self.args.run_dir, "latest.json.tmp"), "w") as f:
                json.dump({"path": path, "step": self.step}, f)
            os.replace(os.path.join(self.args.run_dir, "latest.json.tmp"),
                       os.path.join(self.args.run_dir, "latest.json"))
        dist.barrier()

    def maybe_resume(self):
        meta = os.path.join(self.args.run_dir, "latest.json")
        if not os.path.exists(meta):
            return
        with open(meta) as f:
            path = json.load(f)["path"]
        state = torch.load(path, map_location="cpu")
        self.model.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.epoch, self.batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]
        if self.rank == 0:
            print(f"resumed from {path} at step {self.step}", flush=True)

    # ---------------------------------------------------------------- loops
    @torch.no_grad()
    def evaluate(self):
        self.model.eval()
        acc = torch.zeros(2, device=self.device)
        for batch in self.val_loader:
            batch = {k: v.to(self.device) for k, v in batch.items()}
            loss = self.model(**batch).loss
            acc[0] += loss * batch["input_ids"].size(0)
            acc[1] += batch["input_ids"].size(0)
        dist.all_reduce(acc)
        self.model.train()
        return (acc[0] / acc[1]).item()

    def preempt_requested(self):
        t = torch.tensor([float(TERM)], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item() > 0

    def train(self):
        args = self.args
        if self.rank == 0:
            os.makedirs(args.run_dir, exist_ok=True)
        dist.barrier()
        self.maybe_resume()
        self.model.train()
        while self.epoch < args.epochs:
            self.sampler.set_epoch(self.epoch)
            loader = DataLoader(self.train_ds, batch_size=args.batch_size, sampler=self.sampler,
                                collate_fn=collate, num_workers=4, pin_memory=True, drop_last=True)
            t0 = time.time()
            for i, batch in enumerate(loader):
                if i < self.batch_in_epoch:
                    continue
                batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = self.model(**batch).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                self.step += 1
                self.batch_in_epoch = i + 1

                if self.rank == 0 and self.step % 25 == 0:
                    print(f"step {self.step}/{self.total_steps} loss {loss.item():.4f} "
                          f"lr {self.scheduler.get_last_lr()[0]:.2e} {(time.time() - t0) / 25:.3f}s/it", flush=True)
                    t0 = time.time()

                preempted = self.preempt_requested()
                if preempted or self.step % args.save_interval == 0:
                    self.save_checkpoint()
                if preempted:
                    return False
                if self.step % args.eval_interval == 0:
                    vl = self.evaluate()
                    if self.rank == 0:
                        print(f"step {self.step} val_loss {vl:.4f} ppl {math.exp(vl):.2f}", flush=True)
            self.epoch += 1
            self.batch_in_epoch = 0
        self.save_checkpoint()
        return True


def main():
    signal.signal(signal.SIGTERM, on_term)
    trainer = Trainer(cli())
    finished = trainer.train()
    if trainer.rank == 0:
        print("done" if finished else "exiting after preemption", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
