"""Fine-tune BERT on a GLUE task with DDP, fp16 autocast and gradient accumulation.

torchrun --nproc_per_node=4 04_ddp_bert_cls.py --task mnli --model bert-large-uncased \
    --per_device_batch 16 --grad_accum 2 --output_dir out/bert_mnli
"""
import argparse
import contextlib
import logging
import os

import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

logger = logging.getLogger(__name__)

TASKS = {
    "mnli": (("premise", "hypothesis"), 3, "validation_matched"),
    "qnli": (("question", "sentence"), 2, "validation"),
    "sst2": (("sentence", None), 2, "validation"),
    "qqp": (("question1", "question2"), 2, "validation"),
}


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--task", default="mnli", choices=list(TASKS))
    parser.add_argument("--model", default="bert-base-uncased")
    parser.add_argument("--max_len", type=int, default=128)
    parser.add_argument("--per_device_batch", type=int, default=32)
    parser.add_argument("--grad_accum", type=int, default=1)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--warmup_ratio", type=float, default=0.06)
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--output_dir", default="out")
    return parser.parse_args()


def make_collate(tokenizer, keys, max_len):
    k1, k2 = keys

    def collate(examples):
        a = [ex[k1] for ex in examples]
        b = [ex[k2] for ex in examples] if k2 else None
        enc = tokenizer(a, b, truncation=True, max_length=max_len, padding=True, return_tensors="pt")
        enc["labels"] = torch.tensor([ex["label"] for ex in examples], dtype=torch.long)
        return enc

    return collate


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct = torch.zeros((), device=device)
    seen = torch.zeros((), device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(**batch).logits
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
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(args.seed)

    keys, num_labels, val_split = TASKS[args.task]
    # let rank 0 download / build the arrow cache first
    if rank != 0:
        dist.barrier()
    raw = load_dataset("glue", args.task)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=num_labels)
    if rank == 0:
        dist.barrier()

    train_ds, val_ds = raw["train"], raw[val_split]
    val_ds = val_ds.shard(num_shards=world, index=rank, contiguous=True)
    collate = make_collate(tokenizer, keys, args.max_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.per_device_batch, sampler=train_sampler,
                              collate_fn=collate, num_workers=2, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=128, collate_fn=collate, num_workers=2)

    model.to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr)
    updates_per_epoch = len(train_loader) // args.grad_accum
    total = updates_per_epoch * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * total), total)
    scaler = torch.cuda.amp.GradScaler()

    logger.info("train=%d val=%d world=%d effective batch=%d", len(train_ds), len(raw[val_split]),
                world, args.per_device_batch * args.grad_accum * world)

    best = 0.0
    global_step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for step, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            boundary = (step + 1) % args.grad_accum == 0 or (step + 1) == len(train_loader)
            with (contextlib.nullcontext() if boundary else model.no_sync()):
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = model(**batch).loss / args.grad_accum
                scaler.scale(loss).backward()
            if not boundary:
                continue
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            scale_before = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            if scaler.get_scale() >= scale_before:
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            global_step += 1
            if global_step % 100 == 0:
                logger.info("epoch %d step %d loss %.4f lr %.3e scale %.0f", epoch, global_step,
                            loss.item() * args.grad_accum, scheduler.get_last_lr()[0], scaler.get_scale())

        acc = evaluate(model.module, val_loader, device)
        logger.info("epoch %d %s accuracy %.4f", epoch, val_split, acc)
        if rank == 0 and acc > best:
            best = acc
            save_dir = os.path.join(args.output_dir, "best")
            model.save_pretrained(save_dir)
            tokenizer.save_pretrained(save_dir)
            logger.info("saved new best model to %s", save_dir)
        dist.barrier()

    logger.info("best %s accuracy %.4f", val_split, best)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
