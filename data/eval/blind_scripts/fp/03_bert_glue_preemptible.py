"""Fine-tune a BERT-style encoder on a GLUE task with DDP.

Built for preemptible VMs: checkpoints are written every --save-steps to the
bucket-backed shared mount, and a restarted job (torchrun --max-restarts)
continues from the newest one, including the data position inside the epoch.
"""
import argparse
import glob
import logging
import os
import random
import signal

import numpy as np
import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import (AutoModelForSequenceClassification, AutoTokenizer,
                          DataCollatorWithPadding, get_linear_schedule_with_warmup)

logger = logging.getLogger("glue")

TASK_KEYS = {
    "mnli": ("premise", "hypothesis"),
    "qnli": ("question", "sentence"),
    "qqp": ("question1", "question2"),
    "sst2": ("sentence", None),
}

_preempted = False


def _sigterm(signum, frame):
    global _preempted
    _preempted = True


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="bert-base-uncased")
    parser.add_argument("--task", default="mnli", choices=list(TASK_KEYS))
    parser.add_argument("--output-dir", default="/mnt/gcs/glue-runs/mnli")
    parser.add_argument("--max-len", type=int, default=128)
    parser.add_argument("--per-device-batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-5, help="tuned for 8 GPUs x 32 = 256 per step")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--warmup-ratio", type=float, default=0.06)
    parser.add_argument("--save-steps", type=int, default=500)
    parser.add_argument("--keep", type=int, default=2)
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def prepare_data(args, tokenizer, rank):
    key1, key2 = TASK_KEYS[args.task]

    def tok(batch):
        texts = (batch[key1],) if key2 is None else (batch[key1], batch[key2])
        return tokenizer(*texts, truncation=True, max_length=args.max_len)

    # rank 0 builds the Arrow cache, the others reuse it
    if rank != 0:
        dist.barrier()
    raw = load_dataset("glue", args.task)
    encoded = raw.map(tok, batched=True, remove_columns=[c for c in raw["train"].column_names if c != "label"])
    if rank == 0:
        dist.barrier()
    encoded = encoded.rename_column("label", "labels")
    encoded.set_format("torch")
    val_split = "validation_matched" if args.task == "mnli" else "validation"
    num_labels = raw["train"].features["label"].num_classes
    return encoded["train"], encoded[val_split], num_labels


def save_checkpoint(args, model, optimizer, scheduler, epoch, step_in_epoch, global_step):
    path = os.path.join(args.output_dir, f"checkpoint-{global_step}.pt")
    tmp = path + ".partial"
    torch.save({
        "model": model.module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "epoch": epoch,
        "step_in_epoch": step_in_epoch,
        "global_step": global_step,
        "torch_rng": torch.get_rng_state(),
        "numpy_rng": np.random.get_state(),
        "py_rng": random.getstate(),
    }, tmp)
    os.replace(tmp, path)
    old = sorted(glob.glob(os.path.join(args.output_dir, "checkpoint-*.pt")),
                 key=lambda p: int(p.rsplit("-", 1)[1].split(".")[0]))
    for p in old[:-args.keep]:
        os.remove(p)


def latest_checkpoint(output_dir):
    ckpts = glob.glob(os.path.join(output_dir, "checkpoint-*.pt"))
    if not ckpts:
        return None
    return max(ckpts, key=lambda p: int(p.rsplit("-", 1)[1].split(".")[0]))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct = torch.zeros(1, device=device)
    seen = torch.zeros(1, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        correct += (logits.argmax(-1) == batch["labels"]).sum()
        seen += batch["labels"].numel()
    dist.all_reduce(correct)
    dist.all_reduce(seen)
    model.train()
    return (correct / seen).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, _sigterm)
    seed_everything(args.seed)
    os.makedirs(args.output_dir, exist_ok=True)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    train_ds, val_ds, num_labels = prepare_data(args, tokenizer, rank)
    collate = DataCollatorWithPadding(tokenizer)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    val_loader = DataLoader(val_ds, batch_size=64, sampler=val_sampler, collate_fn=collate, num_workers=2)
    steps_per_epoch = len(train_sampler) // args.per_device_batch

    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=num_labels).to(device)
    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr)
    total_steps = steps_per_epoch * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_steps), total_steps)

    start_epoch, skip_batches, global_step = 0, 0, 0
    resume_from = latest_checkpoint(args.output_dir)
    if resume_from is not None:
        state = torch.load(resume_from, map_location="cpu", weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_epoch, skip_batches, global_step = state["epoch"], state["step_in_epoch"], state["global_step"]
        torch.set_rng_state(state["torch_rng"])
        np.random.set_state(state["numpy_rng"])
        random.setstate(state["py_rng"])
        logger.info("resumed from %s (epoch %d, step %d)", resume_from, start_epoch, global_step)

    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    stopped = False
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        loader = DataLoader(train_ds, batch_size=args.per_device_batch, sampler=train_sampler,
                            collate_fn=collate, num_workers=4, pin_memory=True, drop_last=True)
        model.train()
        for step, batch in enumerate(loader):
            if epoch == start_epoch and step < skip_batches:
                continue
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            global_step += 1

            if global_step % 50 == 0:
                logger.info("epoch %d step %d/%d loss %.4f lr %.2e", epoch, step + 1, steps_per_epoch,
                            loss.item(), scheduler.get_last_lr()[0])

            flag = torch.tensor([int(_preempted)], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            stopped = bool(flag.item())
            if stopped or global_step % args.save_steps == 0:
                save_checkpoint(args, model, optimizer, scheduler, epoch, step + 1, global_step)
                dist.barrier()
            if stopped:
                break
        if stopped:
            logger.info("preempted at step %d, exiting", global_step)
            break

        acc = evaluate(model, val_loader, device)
        logger.info("epoch %d validation accuracy %.4f", epoch, acc)

    if rank == 0 and not stopped:
        model.module.save_pretrained(os.path.join(args.output_dir, "final"))
        tokenizer.save_pretrained(os.path.join(args.output_dir, "final"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
