#!/usr/bin/env python
"""Incident-report summarisation: FLAN-T5-large fine-tuning with the toolkit Trainer (FSDP strategy).

    torchrun --standalone --nproc_per_node=8 18_t5_summarize_fsdp.py \
        --train data/incidents/train.jsonl --val data/incidents/val.jsonl --out /shared/runs/t5-incidents
"""
import argparse
import functools
import json
import logging
import math
import os
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import wandb
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import AutoTokenizer, T5ForConditionalGeneration
from transformers.models.t5.modeling_t5 import T5Block

log = logging.getLogger("t5-incidents")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--val", required=True)
    p.add_argument("--model", default="google/flan-t5-large")
    p.add_argument("--src-len", type=int, default=1024)
    p.add_argument("--tgt-len", type=int, default=192)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--patience", type=int, default=2)
    p.add_argument("--out", required=True)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--wandb-project", default="incident-summaries")
    return p.parse_args()


# --------------------------------------------------------------------- data
def build_or_load_cache(jsonl, tokenizer, args, rank):
    """Rank 0 tokenises once and writes the cache; the others wait, then read it."""
    cache = Path(args.out) / "cache" / (Path(jsonl).stem + ".pt")
    if rank == 0 and not cache.exists():
        rows = [json.loads(l) for l in open(jsonl)]
        src = tokenizer(["summarize: " + r["report"] for r in rows], max_length=args.src_len, truncation=True)["input_ids"]
        tgt = tokenizer([r["summary"] for r in rows], max_length=args.tgt_len, truncation=True)["input_ids"]
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        torch.save({"src": src, "tgt": tgt}, tmp)
        os.replace(tmp, cache)
    dist.barrier()
    return torch.load(cache)


class PairDataset(Dataset):
    def __init__(self, data):
        self.src, self.tgt = data["src"], data["tgt"]

    def __len__(self):
        return len(self.src)

    def __getitem__(self, i):
        return self.src[i], self.tgt[i], 1.0


class EvalShard(Dataset):
    """Equal length on every rank so each FSDP forward has all ranks; padded items weigh 0."""

    def __init__(self, base, rank, world):
        self.base, n = base, len(base)
        self.idx = [rank + k * world for k in range(math.ceil(n / world))]

    def __len__(self):
        return len(self.idx)

    def __getitem__(self, k):
        i = self.idx[k]
        src, tgt, _ = self.base[min(i, len(self.base) - 1)]
        return src, tgt, float(i < len(self.base))


class Collate:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        src, tgt, w = zip(*batch)
        S, T = max(map(len, src)), max(map(len, tgt))
        ids = torch.full((len(batch), S), self.pad_id, dtype=torch.long)
        labels = torch.full((len(batch), T), -100, dtype=torch.long)
        for r, (s, t) in enumerate(zip(src, tgt)):
            ids[r, :len(s)] = torch.tensor(s)
            labels[r, :len(t)] = torch.tensor(t)
        return {"input_ids": ids, "attention_mask": ids.ne(self.pad_id), "labels": labels,
                "weight": torch.tensor(w, dtype=torch.float32)}


# --------------------------------------------------------------------- callbacks
class Callback:
    def on_fit_start(self, trainer): pass
    def on_step_end(self, trainer, logs): pass
    def on_epoch_end(self, trainer, logs): pass
    def on_fit_end(self, trainer): pass


class WandbCallback(Callback):
    def __init__(self, project, config):
        self.project, self.config = project, config

    def on_fit_start(self, trainer):
        if trainer.rank == 0:
            wandb.init(project=self.project, config=self.config, resume="allow")

    def on_step_end(self, trainer, logs):
        if trainer.rank == 0 and trainer.step % 20 == 0:
            wandb.log({**logs, "lr": trainer.scheduler.get_last_lr()[0]}, step=trainer.step)

    def on_epoch_end(self, trainer, logs):
        if trainer.rank == 0:
            wandb.log(logs, step=trainer.step)

    def on_fit_end(self, trainer):
        if trainer.rank == 0:
            wandb.finish()


class ModelCheckpoint(Callback):
    def __init__(self, out_dir):
        self.out_dir, self.best = Path(out_dir), math.inf

    def on_epoch_end(self, trainer, logs):
        is_best = logs["val_loss"] < self.best
        self.best = min(self.best, logs["val_loss"])
        # state_dict() all-gathers the shards, so every rank must call it; only rank 0 gets the tensors
        state = trainer.full_state_dict()
        if trainer.rank == 0:
            torch.save({"model": state, "epoch": trainer.epoch, "step": trainer.step}, self.out_dir / "last.pt")
            if is_best:
                trainer.hf_config.save_pretrained(self.out_dir / "best")
                torch.save(state, self.out_dir / "best" / "pytorch_model.bin")
        dist.barrier()


class EarlyStopping(Callback):
    def __init__(self, patience):
        self.patience, self.best, self.bad = patience, math.inf, 0

    def on_epoch_end(self, trainer, logs):
        if logs["val_loss"] < self.best:
            self.best, self.bad = logs["val_loss"], 0
        else:
            self.bad += 1
        trainer.should_stop = self.bad >= self.patience


# --------------------------------------------------------------------- trainer
class Trainer:
    def __init__(self, model, args, callbacks, steps_per_epoch):
        self.rank = dist.get_rank()
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.hf_config = model.config
        bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
        self.model = FSDP(model, auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                                    transformer_layer_cls={T5Block}),
                          mixed_precision=bf16, sharding_strategy=ShardingStrategy.FULL_SHARD,
                          device_id=torch.cuda.current_device(), use_orig_params=True)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.lr, weight_decay=0.01)
        total = args.epochs * math.ceil(steps_per_epoch / args.accum)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: max(0.0, 1 - s / total))
        self.args, self.callbacks = args, callbacks
        self.epoch, self.start_epoch, self.step, self.should_stop = 0, 0, 0, False

    def _hook(self, name, *a):
        for cb in self.callbacks:
            getattr(cb, name)(self, *a)

    def full_state_dict(self):
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(self.model, StateDictType.FULL_STATE_DICT, cfg):
            return self.model.state_dict()

    def load_full_state_dict(self, path):
        # weights + schedule position only; AdamW moments are rebuilt after a restart
        ckpt = torch.load(path, map_location="cpu")
        with FSDP.state_dict_type(self.model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=True, rank0_only=False)):
            self.model.load_state_dict(ckpt["model"])
        self.start_epoch, self.step = ckpt["epoch"] + 1, ckpt["step"]
        for _ in range(self.step):
            self.scheduler.step()

    def _loss(self, batch):
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                            labels=batch["labels"]).logits.float()
        tok = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch["labels"], ignore_index=-100,
                                                reduction="none")
        mask = batch["labels"].ne(-100).float() * batch["weight"][:, None]
        return (tok * mask).sum(), mask.sum()

    def train_epoch(self, loader):
        self.model.train()
        n = len(loader)
        for i, batch in enumerate(loader):
            boundary = (i + 1) % self.args.accum == 0 or i + 1 == n
            with (nullcontext() if boundary else self.model.no_sync()):
                loss_sum, n_tok = self._loss(batch)
                loss = loss_sum / n_tok.clamp(min=1)
                (loss / self.args.accum).backward()
            if not boundary:
                continue
            gnorm = self.model.clip_grad_norm_(self.args.clip_grad)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            self._hook("on_step_end", {"train/loss": loss.item(), "train/grad_norm": gnorm.item()})

    @torch.no_grad()
    def evaluate(self, loader):
        self.model.eval()
        tot = torch.zeros(2, device=self.device, dtype=torch.float64)
        for batch in loader:
            s, c = self._loss(batch)
            tot += torch.stack([s.double(), c.double()])
        dist.all_reduce(tot)
        return {"val_loss": (tot[0] / tot[1]).item()}

    def fit(self, train_loader, val_loader):
        self._hook("on_fit_start")
        for epoch in range(self.start_epoch, self.args.epochs):
            self.epoch = epoch
            train_loader.sampler.set_epoch(epoch)
            self.train_epoch(train_loader)
            logs = self.evaluate(val_loader)
            if self.rank == 0:
                log.info("epoch %d: %s", epoch, logs)
            self._hook("on_epoch_end", logs)
            if self.should_stop:
                break
        self._hook("on_fit_end")


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    torch.manual_seed(42)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    train_ds = PairDataset(build_or_load_cache(args.train, tokenizer, args, rank))
    val_ds = EvalShard(PairDataset(build_or_load_cache(args.val, tokenizer, args, rank)), rank, world)
    collate = Collate(tokenizer.pad_token_id)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=DistributedSampler(train_ds, shuffle=True),
                              collate_fn=collate, num_workers=2, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size * 2, collate_fn=collate, num_workers=2)

    model = T5ForConditionalGeneration.from_pretrained(args.model)
    callbacks = [WandbCallback(args.wandb_project, {**vars(args), "world_size": world}),
                 ModelCheckpoint(args.out), EarlyStopping(args.patience)]
    trainer = Trainer(model, args, callbacks, steps_per_epoch=len(train_loader))
    last = Path(args.out) / "last.pt"
    if args.resume and last.exists():
        trainer.load_full_state_dict(last)
    trainer.fit(train_loader, val_loader)

    if rank == 0:
        tokenizer.save_pretrained(Path(args.out) / "best")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
