#!/usr/bin/env python
"""Supervised fine-tuning of a 1.5B causal LM on the client's support dialogues.

The toolkit Trainer with the FSDP strategy (full sharding, bf16 mixed precision).

    torchrun --standalone --nproc_per_node=8 11_sft_fsdp_trainer.py \
        --model Qwen/Qwen2-1.5B --train data/sft/train.jsonl --val data/sft/val.jsonl
"""
import argparse
import functools
import json
import logging
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

log = logging.getLogger("sft")
IGNORE = -100


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="Qwen/Qwen2-1.5B")
    p.add_argument("--train", required=True)
    p.add_argument("--val", required=True)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--warmup-ratio", type=float, default=0.03)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--out", default="/shared/ckpt/sft-qwen2-1.5b")
    return p.parse_args()


# ------------------------------------------------------------------------- data
class SFTDataset(Dataset):
    def __init__(self, path, tokenizer, max_len):
        self.examples = []
        with open(path) as fh:
            for line in fh:
                ex = json.loads(line)
                prompt = tokenizer.apply_chat_template(ex["messages"][:-1], tokenize=False, add_generation_prompt=True)
                p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
                r_ids = tokenizer(ex["messages"][-1]["content"] + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
                ids = (p_ids + r_ids)[:max_len]
                labels = ([IGNORE] * len(p_ids) + r_ids)[:max_len]
                self.examples.append((ids, labels))

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        ids, labels = self.examples[i]
        return {"input_ids": ids, "labels": labels, "weight": 1.0}


class EvalShard(Dataset):
    """Same number of items on every rank (FSDP needs all ranks in every forward).
    Padding items get weight 0 so they do not count in the loss."""

    def __init__(self, base, rank, world):
        self.base = base
        per_rank = math.ceil(len(base) / world)
        self.idx = [rank + k * world for k in range(per_rank)]

    def __len__(self):
        return len(self.idx)

    def __getitem__(self, k):
        i = self.idx[k]
        item = dict(self.base[min(i, len(self.base) - 1)])
        item["weight"] = 1.0 if i < len(self.base) else 0.0
        return item


def make_collate(pad_id):
    def collate(batch):
        n = max(len(b["input_ids"]) for b in batch)
        ids = torch.full((len(batch), n), pad_id, dtype=torch.long)
        labels = torch.full((len(batch), n), IGNORE, dtype=torch.long)
        for r, b in enumerate(batch):
            ids[r, : len(b["input_ids"])] = torch.tensor(b["input_ids"])
            labels[r, : len(b["labels"])] = torch.tensor(b["labels"])
        return {"input_ids": ids, "labels": labels, "attention_mask": ids.ne(pad_id) | labels.ne(IGNORE),
                "weight": torch.tensor([b["weight"] for b in batch])}
    return collate


# ------------------------------------------------------------------------- callbacks
class Callback:
    def on_step_end(self, trainer, logs): pass
    def on_eval_end(self, trainer, logs): pass


class LRMonitor(Callback):
    def __init__(self, every=10):
        self.every = every

    def on_step_end(self, trainer, logs):
        if trainer.rank == 0 and trainer.step % self.every == 0:
            log.info("step %d loss %.4f lr %.3e grad_norm %.3f", trainer.step, logs["loss"],
                     trainer.scheduler.get_last_lr()[0], logs["grad_norm"])


class ModelCheckpoint(Callback):
    def __init__(self, out_dir, tokenizer):
        self.out_dir, self.tokenizer, self.best = Path(out_dir), tokenizer, math.inf

    def on_eval_end(self, trainer, logs):
        if trainer.rank != 0 or logs["val_loss"] >= self.best:
            return
        self.best = logs["val_loss"]
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(trainer.model, StateDictType.FULL_STATE_DICT, cfg):
            state = trainer.model.state_dict()
        target = self.out_dir / "best"
        target.mkdir(parents=True, exist_ok=True)
        trainer.hf_config.save_pretrained(target)
        self.tokenizer.save_pretrained(target)
        torch.save(state, target / "pytorch_model.bin")
        log.info("saved best (val_loss %.4f) to %s", self.best, target)


class EarlyStopping(Callback):
    def __init__(self, patience=4):
        self.patience, self.best, self.bad = patience, math.inf, 0

    def on_eval_end(self, trainer, logs):
        if logs["val_loss"] < self.best - 1e-3:
            self.best, self.bad = logs["val_loss"], 0
        else:
            self.bad += 1
        trainer.should_stop = self.bad >= self.patience


# ------------------------------------------------------------------------- trainer
class Trainer:
    def __init__(self, model, layer_cls, args, callbacks):
        self.rank = dist.get_rank()
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.hf_config = model.config
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={layer_cls})
        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
        self.model = FSDP(model, auto_wrap_policy=policy, mixed_precision=mp,
                          sharding_strategy=ShardingStrategy.FULL_SHARD,
                          device_id=torch.cuda.current_device(), use_orig_params=True, limit_all_gathers=True)
        self.args, self.callbacks = args, callbacks
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
        self.scheduler = None
        self.step, self.should_stop = 0, False

    def _emit(self, hook, logs):
        for cb in self.callbacks:
            getattr(cb, hook)(self, logs)

    def _loss(self, batch):
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        shift_logits, shift_labels = logits[:, :-1].float(), batch["labels"][:, 1:]
        tok_loss = torch.nn.functional.cross_entropy(shift_logits.transpose(1, 2), shift_labels,
                                                     ignore_index=IGNORE, reduction="none")
        mask = shift_labels.ne(IGNORE) * batch["weight"][:, None]
        return (tok_loss * mask).sum(), mask.sum()

    @torch.no_grad()
    def evaluate(self, loader):
        self.model.eval()
        tot = torch.zeros(2, device=self.device, dtype=torch.float64)
        for batch in loader:
            loss_sum, n_tok = self._loss(batch)
            tot += torch.stack([loss_sum.double(), n_tok.double()])
        dist.all_reduce(tot)
        self.model.train()
        return {"val_loss": (tot[0] / tot[1].clamp(min=1)).item()}

    def fit(self, train_loader, val_loader):
        accum = self.args.grad_accum
        total = self.args.epochs * (len(train_loader) // accum)
        self.scheduler = get_cosine_schedule_with_warmup(self.optimizer, int(self.args.warmup_ratio * total), total)
        self.model.train()
        for epoch in range(self.args.epochs):
            train_loader.sampler.set_epoch(epoch)
            t0 = time.time()
            for i, batch in enumerate(train_loader):
                loss_sum, n_tok = self._loss(batch)
                (loss_sum / n_tok.clamp(min=1) / accum).backward()
                if (i + 1) % accum:
                    continue
                grad_norm = self.model.clip_grad_norm_(self.args.clip_grad)
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                self.step += 1
                self._emit("on_step_end", {"loss": (loss_sum / n_tok.clamp(min=1)).item(),
                                           "grad_norm": grad_norm.item()})
                if self.step % self.args.eval_every == 0:
                    logs = self.evaluate(val_loader)
                    if self.rank == 0:
                        log.info("eval step %d: %s", self.step, logs)
                    self._emit("on_eval_end", logs)
                    if self.should_stop:
                        return
            if self.rank == 0:
                log.info("epoch %d done in %.1f min", epoch, (time.time() - t0) / 60)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    torch.manual_seed(0)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    train_ds = SFTDataset(args.train, tokenizer, args.max_len)
    val_ds = EvalShard(SFTDataset(args.val, tokenizer, args.max_len), rank, world)
    collate = make_collate(tokenizer.pad_token_id)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=DistributedSampler(train_ds, shuffle=True),
                              collate_fn=collate, num_workers=2, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, collate_fn=collate, num_workers=2)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layer_cls = type(model.model.layers[0])

    callbacks = [LRMonitor(), ModelCheckpoint(args.out, tokenizer), EarlyStopping()]
    trainer = Trainer(model, layer_cls, args, callbacks)
    trainer.fit(train_loader, val_loader)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
