"""
CoNLL-2003 NER, bert-large-cased, custom PyTorch DDP loop with Weights & Biases tracking.

    torchrun --nproc_per_node=8 10_ner_conll_wandb.py --run_name bert-large-conll-lr3e-5 --lr 3e-5
"""
import argparse
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import wandb
from datasets import load_dataset
from seqeval.metrics import accuracy_score, f1_score, precision_score, recall_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForTokenClassification, AutoTokenizer, DataCollatorForTokenClassification, get_linear_schedule_with_warmup

logger = logging.getLogger(__name__)


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_name_or_path", default="bert-large-cased")
    parser.add_argument("--project", default="ner-conll03")
    parser.add_argument("--run_name", default=None)
    parser.add_argument("--output_dir", default="outputs/conll03")
    parser.add_argument("--batch_size", type=int, default=8, help="per device")
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--warmup_ratio", type=float, default=0.1)
    parser.add_argument("--max_length", type=int, default=192)
    parser.add_argument("--label_all_tokens", action="store_true")
    parser.add_argument("--log_steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


def tokenize_fn(examples, tokenizer, max_length, label_all_tokens):
    enc = tokenizer(examples["tokens"], truncation=True, max_length=max_length, is_split_into_words=True)
    labels = []
    for i, tags in enumerate(examples["ner_tags"]):
        word_ids = enc.word_ids(batch_index=i)
        prev = None
        row = []
        for w in word_ids:
            if w is None:
                row.append(-100)
            elif w != prev:
                row.append(tags[w])
            else:
                row.append(tags[w] if label_all_tokens else -100)
            prev = w
        labels.append(row)
    enc["labels"] = labels
    return enc


@torch.no_grad()
def evaluate(model, dataloader, label_list, device):
    model.eval()
    collected = []
    for batch in dataloader:
        sent_ids = batch.pop("sent_id")
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(**batch).logits
        predictions = logits.argmax(dim=2).cpu().numpy()
        labels = batch["labels"].cpu().numpy()
        for sid, pred, lab in zip(sent_ids.tolist(), predictions, labels):
            keep = lab != -100
            collected.append((sid, [label_list[p] for p in pred[keep]], [label_list[l] for l in lab[keep]]))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, collected)
    model.train()
    dedup = {}
    for part in gathered:
        for sid, p, l in part:
            dedup[sid] = (p, l)
    ids = sorted(dedup)
    preds, refs = [dedup[i][0] for i in ids], [dedup[i][1] for i in ids]
    return {
        "precision": precision_score(refs, preds),
        "recall": recall_score(refs, preds),
        "f1": f1_score(refs, preds),
        "accuracy": accuracy_score(refs, preds),
    }


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)

    run = wandb.init(project=args.project, name=args.run_name,
                     config={**vars(args), "world_size": world_size})

    raw = load_dataset("conll2003")
    label_list = raw["train"].features["ner_tags"].feature.names
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)

    if rank != 0:
        dist.barrier()
    tokenized = raw.map(
        tokenize_fn,
        batched=True,
        remove_columns=raw["train"].column_names,
        fn_kwargs={"tokenizer": tokenizer, "max_length": args.max_length, "label_all_tokens": args.label_all_tokens},
    )
    if rank == 0:
        dist.barrier()
    train_ds = tokenized["train"]
    val_ds = tokenized["validation"].add_column("sent_id", list(range(len(tokenized["validation"]))))
    test_ds = tokenized["test"].add_column("sent_id", list(range(len(tokenized["test"]))))

    collator = DataCollatorForTokenClassification(tokenizer)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, sampler=train_sampler, batch_size=args.batch_size, collate_fn=collator,
                              num_workers=4, pin_memory=True)
    val_loader = DataLoader(val_ds, sampler=DistributedSampler(val_ds, shuffle=False), batch_size=64,
                            collate_fn=collator)
    test_loader = DataLoader(test_ds, sampler=DistributedSampler(test_ds, shuffle=False), batch_size=64,
                             collate_fn=collator)

    model = AutoModelForTokenClassification.from_pretrained(
        args.model_name_or_path,
        num_labels=len(label_list),
        id2label={i: l for i, l in enumerate(label_list)},
        label2id={l: i for i, l in enumerate(label_list)},
    )
    model.to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if n.endswith("bias") or "LayerNorm" in n else decay).append(p)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr)
    num_steps = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * num_steps), num_steps)

    global_step = 0
    best_f1 = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            outputs = model(**batch)
            loss = outputs.loss
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            global_step += 1
            if global_step % args.log_steps == 0:
                wandb.log({"train/loss": loss.item(), "train/grad_norm": grad_norm.item(),
                           "train/lr": scheduler.get_last_lr()[0], "epoch": epoch}, step=global_step)

        val = evaluate(model, val_loader, label_list, device)
        if rank == 0:
            logger.info("epoch %d (%.1f min): %s", epoch, (time.time() - tic) / 60, val)
            wandb.log({f"val/{k}": v for k, v in val.items()}, step=global_step)
            if val["f1"] > best_f1:
                best_f1 = val["f1"]
                model.module.save_pretrained(args.output_dir)
                tokenizer.save_pretrained(args.output_dir)
                run.summary["best_val_f1"] = best_f1
        dist.barrier()

    test = evaluate(model, test_loader, label_list, device)
    if rank == 0:
        logger.info("test: %s", test)
        wandb.log({f"test/{k}": v for k, v in test.items()}, step=global_step)
    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
