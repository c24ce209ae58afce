"""Domain-adaptive pre-training of a small GPT on the client's contract corpus.

    torchrun --standalone --nproc_per_node=8 08_contracts_gpt_pretrain.py \
        --train-txt /data/contracts/train.txt --val-txt /data/contracts/val.txt
"""
import argparse
import logging
import math
import os
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

log = logging.getLogger("contracts-lm")


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-txt", required=True)
    ap.add_argument("--val-txt", required=True)
    ap.add_argument("--tokenizer", default="gpt2")
    ap.add_argument("--cache-dir", default="/data/contracts/.token_cache")
    ap.add_argument("--block-size", type=int, default=1024)
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--n-embd", type=int, default=768)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--grad-accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--min-lr", type=float, default=6e-5)
    ap.add_argument("--warmup-steps", type=int, default=1000)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--clip-grad", type=float, default=1.0)
    ap.add_argument("--eval-every", type=int, default=1000)
    ap.add_argument("--out", default="runs/contracts_gpt")
    return ap.parse_args()


# ------------------------------------------------------------------ data
def load_or_build_tokens(text_path, tokenizer, cache_dir):
    cache = Path(cache_dir) / f"{Path(text_path).stem}.{tokenizer.name_or_path.replace('/', '_')}.npy"
    if cache.exists():
        return np.load(cache, mmap_mode="r")
    log.info("tokenizing %s -> %s", text_path, cache)
    ids = []
    with open(text_path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if line:
                ids.extend(tokenizer(line)["input_ids"])
                ids.append(tokenizer.eos_token_id)
    arr = np.asarray(ids, dtype=np.uint16)
    cache.parent.mkdir(parents=True, exist_ok=True)
    np.save(cache, arr)
    return np.load(cache, mmap_mode="r")


class BlockDataset(Dataset):
    def __init__(self, tokens, block_size):
        self.tokens, self.block = tokens, block_size

    def __len__(self):
        return (len(self.tokens) - 1) // self.block

    def __getitem__(self, i):
        chunk = torch.from_numpy(self.tokens[i * self.block: (i + 1) * self.block + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


# ------------------------------------------------------------------ callbacks
class Callback:
    def on_step_end(self, trainer, logs): pass
    def on_eval_end(self, trainer, logs): pass


class LRMonitor(Callback):
    def __init__(self, every=50):
        self.every, self.t = every, time.time()

    def on_step_end(self, trainer, logs):
        if trainer.is_main and trainer.step % self.every == 0:
            dt, self.t = time.time() - self.t, time.time()
            log.info("step %d | loss %.4f | lr %.2e | %.2fs/it", trainer.step, logs["loss"],
                     trainer.optimizer.param_groups[0]["lr"], dt / self.every)


class ModelCheckpoint(Callback):
    def __init__(self, out):
        self.out, self.best = Path(out), math.inf

    def on_eval_end(self, trainer, logs):
        if not trainer.is_main:
            return
        if logs["val_loss"] < self.best:
            self.best = logs["val_loss"]
            trainer.raw_model.save_pretrained(self.out / "best")
        torch.save({"optimizer": trainer.optimizer.state_dict(), "step": trainer.step}, self.out / "trainer_state.pt")


class EarlyStopping(Callback):
    def __init__(self, patience=5):
        self.patience, self.best, self.bad = patience, math.inf, 0

    def on_eval_end(self, trainer, logs):
        if logs["val_loss"] < self.best:
            self.best, self.bad = logs["val_loss"], 0
        else:
            self.bad += 1
        trainer.should_stop = self.bad >= self.patience


# ------------------------------------------------------------------ trainer
class Trainer:
    def __init__(self, model, optimizer, lr_fn, device, args, callbacks):
        self.device = device
        self.is_main = dist.get_rank() == 0
        self.model = DDP(model.to(device), device_ids=[device.index])
        self.optimizer, self.lr_fn, self.args, self.callbacks = optimizer, lr_fn, args, callbacks
        self.step = 0
        self.should_stop = False

    @property
    def raw_model(self):
        return self.model.module

    def _emit(self, hook, logs):
        for cb in self.callbacks:
            getattr(cb, hook)(self, logs)

    @torch.no_grad()
    def evaluate(self, loader):
        model = self.raw_model
        model.eval()
        tot = torch.zeros(2, device=self.device, dtype=torch.float64)
        for x, y in loader:
            x, y = x.to(self.device), y.to(self.device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1),
                                                     reduction="sum")
            tot += torch.stack([loss.double(), torch.tensor(y.numel(), device=self.device, dtype=torch.float64)])
        dist.all_reduce(tot)
        model.train()
        val_loss = (tot[0] / tot[1]).item()
        return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 20))}

    def fit(self, train_loader, val_loader, epochs):
        accum = self.args.grad_accum
        self.model.train()
        for epoch in range(epochs):
            train_loader.sampler.set_epoch(epoch)
            for i, (x, y) in enumerate(train_loader):
                x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
                sync = (i + 1) % accum == 0
                with (nullcontext() if sync else self.model.no_sync()):
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        loss = self.model(input_ids=x, labels=y).loss
                    (loss / accum).backward()
                if not sync:
                    continue
                for g in self.optimizer.param_groups:
                    g["lr"] = self.lr_fn(self.step)
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.clip_grad)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                self.step += 1
                self._emit("on_step_end", {"loss": loss.item()})
                if self.step % self.args.eval_every == 0:
                    logs = self.evaluate(val_loader)
                    if self.is_main:
                        log.info("eval @ %d: %s", self.step, logs)
                    self._emit("on_eval_end", logs)
                    if self.should_stop:
                        return


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    device = torch.device("cuda", local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s")
    torch.manual_seed(1337)

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    train_tokens = load_or_build_tokens(args.train_txt, tokenizer, args.cache_dir)
    val_tokens = load_or_build_tokens(args.val_txt, tokenizer, args.cache_dir)
    train_ds = BlockDataset(train_tokens, args.block_size)
    val_ds = BlockDataset(val_tokens, args.block_size)

    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=DistributedSampler(train_ds, shuffle=True),
                              num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)),
                            batch_size=args.batch_size, num_workers=2)

    config = GPT2Config(vocab_size=len(tokenizer), n_positions=args.block_size, n_layer=args.n_layer,
                        n_head=args.n_embd // 64, n_embd=args.n_embd)
    model = GPT2LMHeadModel(config)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95), fused=True)
    total = args.epochs * len(train_loader) // args.grad_accum

    def lr_fn(step):
        if step < args.warmup_steps:
            return args.lr * (step + 1) / args.warmup_steps
        prog = min(1.0, (step - args.warmup_steps) / max(1, total - args.warmup_steps))
        return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * prog))

    callbacks = [LRMonitor(), ModelCheckpoint(args.out), EarlyStopping()]
    trainer = Trainer(model, optimizer, lr_fn, device, args, callbacks)
    trainer.fit(train_loader, val_loader, args.epochs)

    if rank == 0:
        trainer.raw_model.save_pretrained(Path(args.out) / "final")
        tokenizer.save_pretrained(Path(args.out) / "final")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
